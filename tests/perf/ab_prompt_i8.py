"""CPU prompt speed, A/B/C of the native linears' prompt math: the exact fp32 tiles + GEMM, int16
activations (`kernels/cpu/i16_gemm.h`) and int8 activations in llama.cpp's formats
(`kernels/cpu/i8_gemm.h`), `localllm bench` run in this process with `linear_native.PROMPT_I16` /
`PROMPT_I8` switched in turn (a busy box's load falls on all alike).

Not a test: its output goes, with the command, machine, date and load, into
tests/perf/results/cpu.md.

    python tests/perf/ab_prompt_i8.py MODEL.gguf [MODEL.gguf ...] [--rounds 2] [--threads 2]
        [-p 512] [-r 3] [--variants fp32 int16 int8] [--llama-bench PATH]
    python tests/perf/ab_prompt_i8.py --shapes Q4_K:2048:8192 Q6_K:2048:8192 [-p 512]

`--llama-bench` runs llama.cpp's llama-bench on the same file after each round (same threads).
`--shapes TYPE:N:K` times one linear alone (`NativeLinear.matmul` on p prompt rows, random blocks)
every way, alternating call by call, and prints the minima and GOP/s (2 x p x N x K operations).
"""

import argparse
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from localllm.app.bench import main as bench
from localllm.kernels.cpu import block_linear
from localllm.kernels.quant import QuantType, linear_native

VARIANTS = {"fp32": (False, False), "int16": (True, False), "int8": (False, True)}


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def shapes(specs: list[str], t: int, threads: int, rounds: int, variants: list[str]) -> None:
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
            for v in variants:
                lin.prompt_i16, lin.prompt_i8 = VARIANTS[v]
                s = time.perf_counter()
                with linear_native.prompt_rows(True):  # as a prompt's rows, whatever t
                    lin.matmul(x)
                best[v] = min(best.get(v, 9e9), time.perf_counter() - s)
        ops = 2 * t * n * k / 1e9
        cols = ", ".join(f"{v} {best[v] * 1e3:.1f} ms ({ops / best[v]:.0f} GOP/s)"
                         for v in variants)  # fmt: skip
        print(f"{spec} t={t}: {cols}, load {_load()}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*")
    ap.add_argument("--shapes", nargs="+", default=[], metavar="TYPE:N:K")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--llama-bench", default=None, metavar="PATH")
    args = ap.parse_args()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, "
          f"load {_load()}")  # fmt: skip
    if args.shapes:
        shapes(args.shapes, args.p, args.threads, max(args.r, 3), args.variants)
    for model in args.models:
        for rnd in range(args.rounds):
            for v in args.variants:
                linear_native.PROMPT_I16, linear_native.PROMPT_I8 = VARIANTS[v]  # read per weight
                print(f"## {os.path.basename(model)} round {rnd + 1}, prompt {v}, "
                      f"load {_load()}", flush=True)  # fmt: skip
                bench(["-m", model, "-p", str(args.p), "-n", "0", "-r", str(args.r),
                       "-t", str(args.threads)])  # fmt: skip
            if args.llama_bench:
                cmd = [args.llama_bench, "-m", model, "-p", str(args.p), "-n", "0", "-r",
                       str(args.r), "-t", str(args.threads)]  # fmt: skip
                out = subprocess.run(cmd, capture_output=True, text=True, check=False).stdout
                print("## llama.cpp", *(ln for ln in out.splitlines() if f"pp{args.p}" in ln))
    linear_native.PROMPT_I16, linear_native.PROMPT_I8 = VARIANTS["fp32"]


if __name__ == "__main__":
    main()
