"""llama-bench-style speed figures of llama.cpp (llama-cpp-python) on one GGUF file. Not a test.

Runs under the reference venv, never imports localllm::

    /root/refvenv/bin/python tests/perf/bench_llamacpp.py --model X.gguf --threads 2 --reps 3 --json

Measures, after one untimed warm-up of each:

* ``pp<N>`` (default pp512): ``eval()`` of exactly N prompt tokens (a fixed English text from
  Python's docs, repeated if needed) into an empty KV cache, logits for the last token only.
* ``tg<N>`` (default tg128): after a short prompt (not timed), N single-token ``eval()`` calls, each
  token chosen by numpy argmax over the last logits (greedy; Python binding overhead included,
  about 0.1-0.3 ms/token, unlike llama-bench which feeds random tokens without sampling).

Reports tokens/s per repetition with median, min and max, the model load time (mmap), and the
process's peak RSS (``ru_maxrss``; mmapped weight pages count once touched). With ``--json`` stdout
carries only one JSON object (llama.cpp's own logging is silenced), so a caller can run::

    subprocess.run(["/root/refvenv/bin/python", "tests/perf/bench_llamacpp.py", "--model", p,
                    "--threads", "2", "--reps", "3", "--json"], capture_output=True, text=True)

and ``json.loads(stdout)``. Wall-clock figures on a shared 2-core machine swing by +-25 %; compare
runs made close together, never across days.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time

import numpy as np

SHORT_PROMPT = "The capital of France is"


def _text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in ("objects", "exceptions", "execmodel", "naming"))


def _stats(xs: list[float]) -> dict:
    return {
        "median": round(statistics.median(xs), 2),
        "min": round(min(xs), 2),
        "max": round(max(xs), 2),
        "runs": [round(x, 2) for x in xs],
    }


def _last_logits(llm, llama_cpp):
    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))


def bench(a) -> dict:
    import llama_cpp
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(
        model_path=a.model,
        n_ctx=a.n_ctx,
        n_batch=a.n_batch,
        n_ubatch=a.n_ubatch,
        n_threads=a.threads,
        n_threads_batch=a.threads,
        logits_all=False,
        flash_attn=a.flash_attn,
        verbose=False,
    )
    load_s = time.perf_counter() - t0

    ids = llm.tokenize(_text().encode("utf-8"), add_bos=True, special=False)
    while len(ids) < a.n_prompt:
        ids = ids + ids
    pp_ids = ids[: a.n_prompt]
    short = llm.tokenize(SHORT_PROMPT.encode("utf-8"), add_bos=True, special=False)
    if len(short) + a.n_gen > a.n_ctx or a.n_prompt > a.n_ctx:
        raise SystemExit("n_ctx too small for the requested sizes")

    def run_pp() -> float:
        llm.reset()
        t = time.perf_counter()
        llm.eval(pp_ids)
        return a.n_prompt / (time.perf_counter() - t)

    def run_tg() -> float:
        llm.reset()
        llm.eval(short)
        t = time.perf_counter()
        tok = int(np.argmax(_last_logits(llm, llama_cpp)))
        for _ in range(a.n_gen):
            llm.eval([tok])
            tok = int(np.argmax(_last_logits(llm, llama_cpp)))
        return a.n_gen / (time.perf_counter() - t)

    res: dict = {}
    for name, fn, n in (("pp", run_pp, a.n_prompt), ("tg", run_tg, a.n_gen)):
        if n <= 0:
            continue
        for _ in range(a.warmup):
            fn()
        res[f"{name}{n}"] = {"tok_s": _stats([fn() for _ in range(a.reps)]), "n_tokens": n}
    cp = llm.context_params
    return {
        "engine": "llama.cpp",
        "llama_cpp_python": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "model": os.path.abspath(a.model),
        "model_size_bytes": os.path.getsize(a.model),
        "model_desc": llm._model.desc(),
        "threads": a.threads,
        "reps": a.reps,
        "warmup": a.warmup,
        "settings": {
            "n_ctx": a.n_ctx,
            "n_batch": llm.n_batch,
            "n_ubatch": int(cp.n_ubatch),
            "type_k": int(cp.type_k),
            "type_v": int(cp.type_v),
            "flash_attn_type": int(cp.flash_attn_type),
        },
        "load_s": round(load_s, 3),
        **res,
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="GGUF file")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions of each test")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs before timing")
    ap.add_argument("--n-prompt", type=int, default=512, help="pp size (0 skips)")
    ap.add_argument("--n-gen", type=int, default=128, help="tg size (0 skips)")
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--n-ubatch", type=int, default=512)
    ap.add_argument("--flash-attn", action="store_true", help="enable flash attention")
    ap.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    a = ap.parse_args(argv)
    out = bench(a)
    if a.json:
        print(json.dumps(out))
        return 0
    print(
        f"{out['model_desc']}  ({out['model_size_bytes'] / 2**20:.1f} MiB), "
        f"threads={a.threads}, llama-cpp-python {out['llama_cpp_python']}"
    )
    print(
        f"load {out['load_s']:.3f} s, peak RSS {out['peak_rss_mib']} MiB, "
        f"loadavg {out['loadavg_1m']}"
    )
    for k in (f"pp{a.n_prompt}", f"tg{a.n_gen}"):
        if k in out:
            s = out[k]["tok_s"]
            print(
                f"{k:>6}: {s['median']:8.2f} tok/s  (min {s['min']:.2f}, max {s['max']:.2f}, "
                f"n={a.reps})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
