"""llama.cpp counterpart of bench_engine.py section 1: throughput of c concurrent sequences.

Runs under the reference venv, never imports localllm (nor torch)::

    /root/refvenv/bin/python tests/perf/bench_llamacpp_batched.py --model X.gguf --threads 2 \
        [--concurrency 1,4,16] [--prompt-len 64] [--gen 64] [--reps 2] [--json]

Built on llama.cpp's low-level API (llama-cpp-python bindings), the way examples/parallel does
it: one context with n_seq_max = c (n_ctx = c x the per-sequence need, rounded up to 256),
n_batch = n_ubatch = 512, flash attention off (as in our goldens), f16 KV cache. Each run clears
the KV memory, then

* prefill: the c prompts (the same texts as bench_engine.py, loaded from it by path, tokenized
  with llama.cpp's tokenizer and cut to exactly --prompt-len tokens) packed into batches of up to
  n_batch tokens, logits only for each sequence's last prompt token; a sequence's first token is
  the argmax of those logits, its TTFT the time from the start of the run to that argmax;
* decode: --gen - 1 llama_decode calls of c tokens, one per sequence, each followed by a numpy
  argmax per sequence (greedy; no EOS check, like ignore_eos).

Reports, per c, the best (least wall time) of --reps runs after one warm-up: wall time, aggregate
tok/s (c*gen/wall), mean TTFT, mean TPOT ((last - first token time) / (gen - 1)), and a
fingerprint of the prompt token ids, which bench_engine.py --compare checks against its own.
With --json stdout carries only one JSON object (llama.cpp's logging is silenced).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def _shared():
    """bench_engine.py, loaded by path: its prompt builders use only the standard library."""
    spec = importlib.util.spec_from_file_location("bench_engine", HERE / "bench_engine.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _log_errors(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    if level == 4:  # GGML_LOG_LEVEL_ERROR
        sys.stderr.write(text.decode("utf-8", "replace"))


class Model:
    def __init__(self, path: str):
        import llama_cpp

        # The bindings' own callback maps ggml's log levels wrongly and prints warnings.
        self._log = llama_cpp.llama_log_callback(_log_errors)  # kept: C holds the pointer
        llama_cpp.llama_log_set(self._log, ctypes.c_void_p(0))
        self.lib = llama_cpp
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(
            path.encode(), llama_cpp.llama_model_default_params()
        )
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {path}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)

    def encode(self, text: str) -> list[int]:
        """add_special=True, parse_special=False: as bench_engine.py's tokenizer call."""
        raw = text.encode("utf-8")
        n = len(raw) + 16
        buf = (self.lib.llama_token * n)()
        k = self.lib.llama_tokenize(self.vocab, raw, len(raw), buf, n, True, False)
        if k < 0:
            raise RuntimeError(f"llama_tokenize needs {-k} slots")
        return list(buf[:k])

    def context(self, n_seq: int, n_ctx: int, a) -> ctypes.c_void_p:
        lib = self.lib
        cp = lib.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = cp.n_ubatch = a.n_batch
        cp.n_seq_max = n_seq
        cp.n_threads = cp.n_threads_batch = a.threads
        cp.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.kv_unified = a.kv_unified
        ctx = lib.llama_init_from_model(self.model, cp)
        if not ctx:
            raise SystemExit(f"llama.cpp could not make a context of {n_ctx} for {n_seq} sequences")
        return ctx

    def close(self) -> None:
        self.lib.llama_model_free(self.model)


def _fill(batch, items: list[tuple[int, int, int, bool]]) -> None:
    """items: (sequence, position, token, wants logits)."""
    for k, (seq, pos, tok, out) in enumerate(items):
        batch.token[k] = tok
        batch.pos[k] = pos
        batch.n_seq_id[k] = 1
        batch.seq_id[k][0] = seq
        batch.logits[k] = 1 if out else 0
    batch.n_tokens = len(items)


def run(m: Model, ctx, batch, prompts: list[list[int]], gen: int, n_batch: int) -> dict:
    lib = m.lib
    lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
    c = len(prompts)
    toks: list[list[int]] = [[] for _ in range(c)]
    first = [0.0] * c
    last = [0.0] * c

    def decode(items: list[tuple[int, int, int, bool]]) -> None:
        _fill(batch, items)
        rc = lib.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        for k, (seq, _, _, out) in enumerate(items):
            if out:
                logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, k), (m.n_vocab,))
                toks[seq].append(int(np.argmax(logits)))
        now = time.perf_counter()
        for seq, _, _, out in items:
            if out:
                first[seq] = first[seq] or now
                last[seq] = now

    t0 = time.perf_counter()
    flat = [
        (s, p, t, p == len(ids) - 1) for s, ids in enumerate(prompts) for p, t in enumerate(ids)
    ]
    for i in range(0, len(flat), n_batch):
        decode(flat[i : i + n_batch])
    for _ in range(gen - 1):
        decode([(s, len(prompts[s]) + len(toks[s]) - 1, toks[s][-1], True) for s in range(c)])
    wall = time.perf_counter() - t0
    tpot = [(b - f) / (gen - 1) for f, b in zip(first, last, strict=True)] if gen > 1 else []
    return {
        "wall_s": wall,
        "ttft_s": [f - t0 for f in first],
        "tpot_s": tpot,
        "generated": sum(len(t) for t in toks),
        "tokens": toks,
    }


def bench(a) -> dict:
    sh = _shared()
    import llama_cpp

    model = sh.resolve_model(a.model)
    t0 = time.perf_counter()
    m = Model(model)
    load_s = time.perf_counter() - t0
    rows = []
    for c in a.concurrency:
        prompts = sh.prompt_ids(m.encode, c, a.prompt_len)
        per_seq = -(-(a.prompt_len + a.gen) // 256) * 256
        ctx = m.context(c, c * per_seq, a)
        batch = llama_cpp.llama_batch_init(max(a.n_batch, c), 0, 1)
        try:
            run(m, ctx, batch, prompts, a.gen, a.n_batch)  # warm-up
            runs = [run(m, ctx, batch, prompts, a.gen, a.n_batch) for _ in range(a.reps)]
            n_ctx = llama_cpp.llama_n_ctx(ctx)
        finally:
            llama_cpp.llama_batch_free(batch)
            llama_cpp.llama_free(ctx)
        best = min(runs, key=lambda r: r["wall_s"])
        rows.append(
            {
                "concurrency": c,
                "prompt_len": a.prompt_len,
                "gen": a.gen,
                "wall_s": round(best["wall_s"], 3),
                "agg_tok_s": round(c * a.gen / best["wall_s"], 2),
                "ttft_ms_mean": sh.ms(sh.mean(best["ttft_s"])),
                "tpot_ms_mean": sh.ms(sh.mean(best["tpot_s"])),
                "generated": best["generated"],
                "n_ctx": n_ctx,
                "walls_s": [round(r["wall_s"], 3) for r in runs],
                "prompt_sha1": sh.digest(prompts),
                "seq0_tokens": best["tokens"][0],
            }
        )
    m.close()
    return {
        "engine": "llama.cpp",
        "llama_cpp_python": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "model": Path(model).name,
        **sh.machine(a.threads),
        "settings": {
            "n_batch": a.n_batch,
            "n_ubatch": a.n_batch,
            "flash_attn": False,
            "kv_unified": a.kv_unified,
            "type_kv": "f16",
        },
        "load_s": round(load_s, 3),
        "concurrency": rows,
    }


def main(argv=None) -> int:
    sh = _shared()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="GGUF path (or gemma3)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2, help="timed runs after one warm-up; best kept")
    ap.add_argument("--concurrency", type=sh.ints, default=[1, 4, 16])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--n-batch", type=int, default=512, help="n_batch and n_ubatch")
    ap.add_argument("--kv-unified", action="store_true", help="one KV buffer for all sequences")
    ap.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    a = ap.parse_args(argv)
    out = bench(a)
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"{out['model']}  threads={a.threads}  llama-cpp-python {out['llama_cpp_python']}  ")
    print(f"loadavg={out['loadavg_1m']}  {out['date']}  settings: {json.dumps(out['settings'])}")
    keys = ("concurrency", "wall_s", "agg_tok_s", "ttft_ms_mean", "tpot_ms_mean")
    hdr = ["c", "wall s", "agg tok/s", "mean TTFT ms", "mean TPOT ms"]
    print(f"\n### llama.cpp concurrency: {a.prompt_len}-token prompts, {a.gen} tokens each")
    print(sh.table(hdr, [[r[k] for k in keys] for r in out["concurrency"]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
