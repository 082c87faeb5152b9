"""CPU benchmark: our engine next to llama.cpp on the same GGUF file, in the same run.

Measures what llama-bench reports: pp512 (prompt tokens/s over a fixed 512-token prompt) and tg128
(decode tokens/s after a short prompt), plus load time and peak RSS, each engine in its own
subprocess so RSS and thread pools do not mix. Not a test: a script whose output goes, with the
command, machine and date, into tests/perf/results/cpu.md.

    python tests/perf/bench_cpu.py --model PATH [--threads 2] [--reps 3] \
        [--llamacpp-python /root/refvenv/bin/python]
"""

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEXT = (
    "The history of computing is a story of ever smaller machines doing ever larger work. "
    "Early computers filled rooms and consumed the power of a small town, yet they could "
    "perform only a few thousand operations each second. "
)


def ours(model: str, threads: int, reps: int, pp: int, tg: int) -> dict:
    t0 = time.perf_counter()
    import torch

    torch.set_num_threads(threads)
    from localllm.engine.generator import Generator
    from localllm.engine.sampling.params import SamplingParams

    gen = Generator.load(model)
    load = time.perf_counter() - t0
    tok = gen.tokenizer
    ids = tok.encode(TEXT * 40, add_special=False, parse_special=False)[:pp]
    assert len(ids) == pp, "text too short for the prompt length"
    pp_rates, tg_rates = [], []
    greedy = SamplingParams(temperature=0.0, max_tokens=tg, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    list(gen.stream(ids[:64], one))  # warm-up, as llama-bench does: first-call allocations
    list(gen.stream(ids[:16], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)))
    for _ in range(reps):
        # pp: prefill only (logits for the last position, as llama.cpp computes them)
        list(gen.stream(ids, one))
        pp_rates.append(pp / gen.last_stats.prefill_seconds)
        n = sum(1 for _ in gen.stream(ids[:16], greedy))
        tg_rates.append(n / gen.last_stats.decode_seconds)
    return {
        "engine": "localllm",
        "load_s": load,
        f"pp{pp}": {"tok_s": _summary(pp_rates), "n_tokens": pp},
        f"tg{tg}": {"tok_s": _summary(tg_rates), "n_tokens": tg},
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--llamacpp-python", default="/root/refvenv/bin/python")
    ap.add_argument("--only", choices=["ours", "llamacpp"], help="run one engine in-process")
    args = ap.parse_args()
    if args.only == "ours":
        print(json.dumps(ours(args.model, args.threads, args.reps, args.pp, args.tg)))
        return
    results = []
    for engine in ("llamacpp", "ours"):
        if engine == "ours":
            cmd = [sys.executable, __file__, "--model", args.model, "--only", "ours"]
            cmd += ["--threads", str(args.threads), "--reps", str(args.reps)]
            cmd += ["--pp", str(args.pp), "--tg", str(args.tg)]
        else:
            cmd = [args.llamacpp_python, str(HERE / "bench_llamacpp.py"), "--model", args.model]
            cmd += ["--threads", str(args.threads), "--reps", str(args.reps), "--json"]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            print(out.stderr, file=sys.stderr)
            raise SystemExit(f"{engine} failed")
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    report = {
        "model": Path(args.model).name,
        "machine": f"{platform.machine()} {platform.processor() or ''} threads={args.threads}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "results": results,
    }
    print(json.dumps(report, indent=1))
    ll, us = results
    for k in (f"pp{args.pp}", f"tg{args.tg}"):
        a, b = ll[k]["tok_s"]["median"], us[k]["tok_s"]["median"]
        print(f"{k}: llama.cpp {a:.1f} tok/s, localllm {b:.1f} tok/s, ratio {b / a:.2f}")
    print(
        f"load: llama.cpp {ll['load_s']:.2f} s, localllm {us['load_s']:.2f} s; peak RSS "
        f"llama.cpp {ll['peak_rss_mib']:.0f} MiB, localllm {us['peak_rss_mib']:.0f} MiB"
    )


if __name__ == "__main__":
    main()
