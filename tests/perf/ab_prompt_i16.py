"""CPU prompt speed, A/B of the native linears' prompt math: the exact fp32 tiles + GEMM against
int16 activations (`kernels/cpu/i16_gemm.h`), `localllm bench` run in this process with
`linear_native.PROMPT_I16` off and on in turn (a busy box's load falls on both alike).

Not a test: its output goes, with the command, machine, date and load, into
tests/perf/results/cpu.md.

    python tests/perf/ab_prompt_i16.py MODEL.gguf [MODEL.gguf ...] [--rounds 2] [--threads 2]
        [-p 512] [-r 3]
"""

import argparse
import os
import time
from pathlib import Path

from localllm.app.bench import main as bench
from localllm.kernels.quant import linear_native


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-r", type=int, default=3)
    args = ap.parse_args()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores")
    for model in args.models:
        for rnd in range(args.rounds):
            for i16 in (False, True):
                linear_native.PROMPT_I16 = i16  # read as each weight is prepared
                load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
                print(f"## {os.path.basename(model)} round {rnd + 1}, "
                      f"prompt {'int16' if i16 else 'fp32'}, load {load}", flush=True)  # fmt: skip
                bench(["-m", model, "-p", str(args.p), "-n", "0", "-r", str(args.r),
                       "-t", str(args.threads)])  # fmt: skip


if __name__ == "__main__":
    main()
