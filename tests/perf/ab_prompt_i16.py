"""CPU prompt speed, A/B of the native linears' prompt math: the exact fp32 tiles + GEMM against
int16 activations (`kernels/cpu/i16_gemm.h`), `localllm bench` run in this process with
`linear_native.PROMPT_I16` off and on in turn (a busy box's load falls on both alike).

Not a test: its output goes, with the command, machine, date and load, into
tests/perf/results/cpu.md.

    python tests/perf/ab_prompt_i16.py MODEL.gguf [MODEL.gguf ...] [--rounds 2] [--threads 2]
        [-p 512] [-r 3] [--llama-bench PATH]
    python tests/perf/ab_prompt_i16.py --shapes Q4_K:2048:2048 Q6_K:2048:8192 [-p 512]
    python tests/perf/ab_prompt_i16.py MODEL.gguf --attention [--modes rows,tiled] [--forward]

`--attention` A/Bs the CPU prompt chunks' attention instead, both with the default prompt
linears, over the modes named (`kernels.attention.paged.CPU_PROMPT_ATTENTION`: "tiled", the
prompt kernel and default; "rows", each row through the decode kernel; "sdpa", torch's chunk
path), in turn. `--forward` adds, per mode and round, one forward of a -p token prompt in this
process with the time spent inside attention (all layers) beside the whole.

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


def forward_time(model: str, p: int, threads: int, what: str) -> None:
    """One p-token prompt forward (prompt rows, one chunk, a float16 cache as `localllm bench`)
    and the seconds inside attention."""
    from localllm.engine.core.batch import BatchMeta
    from localllm.engine.gguf import open_gguf
    from localllm.engine.loader import build_model
    from localllm.engine.runtime import kv_cache

    torch.set_num_threads(threads)
    gguf = open_gguf(model)
    spent = [0.0]
    inner = kv_cache.paged_attention

    def timed(*a, **k):
        s = time.perf_counter()
        out = inner(*a, **k)
        spent[0] += time.perf_counter() - s
        return out

    try:
        net = build_model(gguf, device="cpu")
        layers, kvh, hd = net.kv_shape()
        kv = kv_cache.PagedKVCache(layers, -(-p // 16), 16, kvh, hd, "f16", "cpu",
                                   net.kv_value_dim())  # fmt: skip
        ids = torch.arange(p) % 1000 + 100
        batch = BatchMeta.contiguous(p, p, 16, prompt=True)
        kv_cache.paged_attention = timed
        with torch.inference_mode(), linear_native.prompt_rows(True):
            net(ids, torch.arange(p), batch, kv)  # (warm-up: libraries, first touches)
            spent[0] = 0.0
            s = time.perf_counter()
            net(ids, torch.arange(p), batch, kv)
            total = time.perf_counter() - s
    finally:
        kv_cache.paged_attention = inner
        gguf.close()
    print(f"## forward {p} tokens, {what}: {total:.2f} s, attention {spent[0]:.3f} s",
          flush=True)  # fmt: skip


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
                    help="A/B the prompt chunks' attention modes (--modes) instead")  # fmt: skip
    ap.add_argument("--modes", default="rows,tiled",
                    help="with --attention: CPU_PROMPT_ATTENTION modes in turn")  # fmt: skip
    ap.add_argument("--forward", action="store_true",
                    help="with --attention: time a -p token forward and its attention")  # fmt: skip
    args = ap.parse_args()
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, "
          f"load {load}")  # fmt: skip
    if args.shapes:
        shapes(args.shapes, args.p, args.threads, max(args.r, 3))
    for model in args.models:
        modes = args.modes.split(",") if args.attention else (False, True)
        for rnd in range(args.rounds):
            for on in modes:
                if args.attention:
                    paged.CPU_PROMPT_ATTENTION = on
                    what = f"attention {on}"
                    if args.forward:
                        forward_time(model, args.p, args.threads, what)
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
