"""Where a many-stream serve's time goes: the engine's steps by kind, in process (issue 38).

Not a test. `bench_serve.py` measures a server from outside; this drives `LLMEngine` directly
with the same prompt mix (its `Prompts`: token-id prompts of --min/--max-prompt tokens with
shared prefixes, --gen tokens each, `ignore_eos`) as --streams closed-loop clients (each starts
its next request when its last one ends, --requests in all), and times every `step()`:

  decode   every scheduled row decodes one token (a CUDA-graph step where the batch fits)
  mixed    decode rows and prompt tokens in one step (eager)
  prompt   prompt tokens only (one sequence: a prompt graph on CUDA where its length fits)

It prints, per kind: steps, wall seconds and share, mean ms, mean decode rows and prompt tokens,
and the output tokens those steps produced; then aggregate output tokens/s. Run it on the serve
call's file with the serve's settings, e.g.::

    python tests/perf/serve_steps.py -m /tmp/llama8b.gguf --device cuda --streams 16 \
        --requests 32 --parallel 64 [--batch-size 2048] [--json FILE]

Host time per step is included (the steps run as a server's loop runs them, nothing synced).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _bench_serve():
    spec = importlib.util.spec_from_file_location("bench_serve", HERE / "bench_serve.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_serve"] = mod  # (its dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


def kind_of(sched) -> tuple[str, int, int]:
    """(kind, decode rows, prompt tokens) of one scheduler output."""
    n = sched.num_scheduled_tokens
    dec = sum(
        1
        for r in sched.requests
        if n[r.request_id] == 1 and r.num_computed_tokens >= r.num_prompt_tokens
    )
    prm = sum(n[r.request_id] for r in sched.requests) - dec
    if prm == 0:
        return "decode", dec, 0
    return ("mixed" if dec else "prompt"), dec, prm


def run(a) -> dict:
    from localllm.engine import EngineArgs, LLMEngine, SamplingParams

    bs = _bench_serve()
    args = EngineArgs(device=a.device, max_num_seqs=a.parallel, max_num_batched_tokens=a.batch_size)
    eng = LLMEngine(a.model, args)
    mix = bs.Mix(min_prompt=a.min_prompt, max_prompt=a.max_prompt)
    text = bs.corpus_text(mix.corpus_tokens() * 2, mix.seed)
    prompts = bs.Prompts(eng.tokenize(text), mix)
    params = SamplingParams(max_tokens=a.gen, temperature=0.0, ignore_eos=True)

    # one warm-up request of each length class is the serve bench's warm-up round
    for i in range(a.warmup):
        eng.add_request(f"warm{i}", prompts.get(f"warm{i}")[0], params)
    while eng.has_unfinished_requests():
        eng.step()

    orig = eng.scheduler.schedule
    log: list[tuple[str, int, int]] = []

    def schedule():
        s = orig()
        if not s.empty:
            log.append(kind_of(s))
        return s

    eng.scheduler.schedule = schedule
    issued = 0
    for _ in range(min(a.streams, a.requests)):
        eng.add_request(f"r{issued}", prompts.get(f"r{issued}")[0], params)
        issued += 1
    times: dict[str, list[float]] = defaultdict(list)
    rows: dict[str, list[tuple[int, int]]] = defaultdict(list)
    out_tokens = 0
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        n0 = len(log)
        t = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t
        if len(log) > n0:
            kind, dec, prm = log[-1]
            times[kind].append(dt)
            rows[kind].append((dec, prm))
        for o in outs:
            if o.finished and issued < a.requests:
                eng.add_request(f"r{issued}", prompts.get(f"r{issued}")[0], params)
                issued += 1
    wall = time.perf_counter() - t0
    out_tokens = a.requests * a.gen
    eng.close()
    table = {}
    for kind in ("decode", "mixed", "prompt"):
        ts = times.get(kind, [])
        if not ts:
            continue
        rs = rows[kind]
        table[kind] = {
            "steps": len(ts),
            "seconds": round(sum(ts), 3),
            "share": round(sum(ts) / wall, 3),
            "mean_ms": round(1e3 * statistics.fmean(ts), 2),
            "p50_ms": round(1e3 * statistics.median(ts), 2),
            "decode_rows": round(statistics.fmean(r[0] for r in rs), 1),
            "prompt_tokens": round(statistics.fmean(r[1] for r in rs), 1),
            "tokens_out": sum(r[0] for r in rs),
        }
    return {
        "streams": a.streams,
        "requests": a.requests,
        "gen": a.gen,
        "batch_size": a.batch_size,
        "wall_s": round(wall, 3),
        "out_tok_s": round(out_tokens / wall, 2),
        "kinds": table,
    }


def report(r: dict) -> str:
    head = (
        f"streams {r['streams']}, {r['requests']} requests x {r['gen']} tokens, -b "
        f"{r['batch_size']}: {r['wall_s']} s, {r['out_tok_s']} out tok/s"
    )
    lines = [
        head,
        "| kind | steps | s | share | mean ms | p50 ms | decode rows | prompt tok | tokens out |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for k, v in r["kinds"].items():
        lines.append(
            f"| {k} | {v['steps']} | {v['seconds']} | {v['share']:.1%} | {v['mean_ms']} | "
            f"{v['p50_ms']} | {v['decode_rows']} | {v['prompt_tokens']} | {v['tokens_out']} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--gen", type=int, default=256)
    p.add_argument("--parallel", type=int, default=64)
    p.add_argument("-b", "--batch-size", type=int, default=512)
    p.add_argument("--min-prompt", type=int, default=512)
    p.add_argument("--max-prompt", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--json")
    a = p.parse_args(argv)
    r = run(a)
    print(report(r), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
