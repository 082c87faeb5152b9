"""Host cost of one launch on the GPU machine (run there; not a test): a Triton kernel through
its JIT entry (`kernel[grid](...)`) with few and with many arguments, the same compiled kernel
through its launcher directly, and small torch ops, as microseconds of host time per call (the
device work is a few microseconds and runs behind). Prompts of MoE models are bound by this
(tests/perf/results/gpu-kernels.md, "Prompts no longer bound by host dispatch": a Python-keyed
cache of compiled kernels cost more than the JIT it skipped).

    python tests/perf/bench_launch.py
"""

import time

import torch
import triton
import triton.language as tl


@triton.jit
def _few(x_ptr, n, B: tl.constexpr):
    i = tl.arange(0, B)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)


@triton.jit
def _many(
    a, b, c, d, e, f, g, h, n0, n1, n2, n3, n4, n5, n6, n7,
    B: tl.constexpr, C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr,
):  # fmt: skip
    i = tl.arange(0, B)
    tl.store(a + i, tl.load(b + i, mask=i < n0), mask=i < n0)


def _per_call(fn, reps: int = 3000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / reps * 1e6


def main() -> None:
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    x = torch.zeros(1024, device=dev)
    ts = [torch.zeros(1024, device=dev) for _ in range(8)]
    ns = [512, 256, 7, 33, 1024, 16, 48, 2]
    few = _few[(1,)]
    many = _many[(4, 2)]
    compiled = _many[(4, 2)](*ts, *ns, B=256, C0=1, C1=2, C2=3, num_warps=4)
    stream = torch.cuda.current_stream().cuda_stream
    meta = compiled.launch_metadata((4, 2, 1), stream, *ts, *ns)

    def direct():
        compiled.run(4, 2, 1, stream, compiled.function, compiled.packed_metadata, meta, None,
                     None, *ts, *ns, 256, 1, 2, 3)  # fmt: skip

    y = torch.zeros(64, device=dev)
    rows = {
        "triton JIT, 2 args + 1 constexpr": lambda: few(x, 512, B=256),
        "triton JIT, 16 args + 4 constexpr": lambda: many(*ts, *ns, B=256, C0=1, C1=2, C2=3),
        "triton launcher direct, 16 args": direct,
        "torch.empty(64)": lambda: torch.empty(64, device=dev),
        "torch add (64)": lambda: y + y,
        "torch .to(bfloat16) (64)": lambda: y.to(torch.bfloat16),
        "torch mm 64x64": lambda: y.view(8, 8) @ y.view(8, 8),
    }
    for name, fn in rows.items():
        try:
            print(f"{name:40s} {_per_call(fn):7.2f} us per call")
        except Exception as exc:  # the launcher's signature differs between Triton versions
            print(f"{name:40s} {type(exc).__name__}: {str(exc)[:80]}")


if __name__ == "__main__":
    main()
