"""CPU prompt speed, A/B of the native linears' prompt math: the exact fp32 tiles + GEMM against
int16 activations (`kernels/cpu/i16_gemm.h`), `localllm bench` run in this process with
`linear_native.PROMPT_I16` off and on in turn (a busy box's load falls on both alike).

Not a test: its output goes, with the command, machine, date and load, into
tests/perf/results/cpu.md.

    python tests/perf/ab_prompt_i16.py MODEL.gguf [MODEL.gguf ...] [--rounds 2] [--threads 2]
        [-p 512] [-r 3] [--llama-bench PATH]
    python tests/perf/ab_prompt_i16.py --shapes Q4_K:2048:2048 Q6_K:2048:8192 [-p 512]
    python tests/perf/ab_prompt_i16.py MODEL.gguf --attention [...]

`--attention` A/Bs the CPU prompt chunks' attention instead, both with the default prompt
linears: torch's SDPA over the chunk against each row through the decode kernel over its own
keys (`kernels.attention.paged.CHUNK_ROWS_NATIVE`, the default: chunk-invariant bits).

`--llama-bench` runs llama.cpp's llama-bench on the same file after each pair (same threads).
`--shapes TYPE:N:K` times one linear alone (`NativeLinear.matmul`, random blocks, p rows) both
ways, alternating call by call, and prints the minima and GFLOP/s.
"""

import argparse
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from localllm.app.bench import main as bench
from localllm.kernels.attention import paged
from localllm.kernels.cpu import block_linear
from localllm.kernels.quant import QuantType, linear_native


def shapes(specs: list[str], t: int, threads: int, rounds: int) -> None:
    torch.set_num_threads(threads)
    kernels = block_linear.load()
    for spec in specs:
        name, n, k = spec.split(":")
        qt, n, k = QuantType[name], int(n), int(k)
        raw = block_linear.random_blocks(qt, n, k, np.random.default_rng(0))
        lin = linear_native.NativeLinear([raw], qt, (n, k), kernels)
        x = torch.randn(t, k)
        best = {}
        for _ in range(rounds + 1):  # (the first round warms up, as the others are timed)
            for i16 in (False, True):
                lin.prompt_i16 = i16
                s = time.perf_counter()
                lin.matmul(x)
                best[i16] = min(best.get(i16, 9e9), time.perf_counter() - s)
        flops = 2 * t * n * k / 1e9
        print(f"{spec} t={t}: fp32 tiles {best[False] * 1e3:.1f} ms "
              f"({flops / best[False]:.0f} GFLOP/s), int16 {best[True] * 1e3:.1f} ms "
              f"({flops / best[True]:.0f} GFLOP/s), x{best[False] / best[True]:.2f}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*")
    ap.add_argument("--shapes", nargs="+", default=[], metavar="TYPE:N:K")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--llama-bench", default=None, metavar="PATH")
    ap.add_argument("--attention", action="store_true",
                    help="A/B the prompt chunks' attention (SDPA, row by row) instead")  # fmt: skip
    args = ap.parse_args()
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, "
          f"load {load}")  # fmt: skip
    if args.shapes:
        shapes(args.shapes, args.p, args.threads, max(args.r, 3))
    for model in args.models:
        for rnd in range(args.rounds):
            for on in (False, True):
                if args.attention:
                    paged.CHUNK_ROWS_NATIVE = on
                    what = f"attention {'row by row' if on else 'SDPA'}"
                else:
                    linear_native.PROMPT_I16 = on  # read as each weight is prepared
                    what = f"prompt {'int16' if on else 'fp32'}"
                load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
                print(f"## {os.path.basename(model)} round {rnd + 1}, {what}, load {load}",
                      flush=True)  # fmt: skip
                bench(["-m", model, "-p", str(args.p), "-n", "0", "-r", str(args.r),
                       "-t", str(args.threads)])  # fmt: skip
            if args.llama_bench:
                cmd = [args.llama_bench, "-m", model, "-p", str(args.p), "-n", "0", "-r",
                       str(args.r), "-t", str(args.threads)]  # fmt: skip
                out = subprocess.run(cmd, capture_output=True, text=True, check=False).stdout
                print("## llama.cpp", *(ln for ln in out.splitlines() if f"pp{args.p}" in ln))


if __name__ == "__main__":
    main()
