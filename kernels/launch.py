"""Triton launches without the JIT's per-call binding, for the kernels a prompt launches per layer.

`kernel[grid](...)` costs ~30 us of host time per call on the H200 machine's host for a kernel of
16 arguments (tests/perf/bench_launch.py: binding, specialization, cache key, metadata), and a
prompt's MoE layer launches ~11 Triton kernels for ~0.8 ms of device work: the host falls behind.
`FastKernel` keeps, per specialization, the compiled kernel the JIT returned and calls its
launcher directly. Its key is at least as fine as Triton's specialization (tensor dtype and
16-byte alignment; integer == 1, divisible by 16, 32- or 64-bit, unsigned; float; bool; the
constexpr and option values), so a hit is the kernel the JIT would have picked. Anything else
(other argument types, the interpreter) goes through the JIT. Imported only where triton is.
"""

import torch
from triton import knobs
from triton.runtime.jit import JITFunction

_PLAIN = (int, float, bool, str)  # constexpr and option values a key can hold


def _spec(a) -> tuple | None:
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() & 15 == 0)
    if isinstance(a, bool):
        return (bool,)
    if isinstance(a, int):
        return (int, a == 1, a & 15 == 0, -(2**31) <= a < 2**31, a >= 2**63)
    if isinstance(a, float):
        return (float,)
    return None  # None, tuples, descriptors: the JIT decides


class FastKernel:
    """`FastKernel(jit_fn)[grid](*args, **constexprs_and_options)`, as `jit_fn[grid](...)`."""

    def __init__(self, fn):
        self.fn = fn
        self.fast = isinstance(fn, JITFunction)  # not under TRITON_INTERPRET=1
        if self.fast:
            self.names = fn.arg_names
            self.defaults = {p.name: p.default for p in fn.params if p.has_default}
        self.compiled: dict[tuple, object] = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(grid, args, kwargs)

    def run(self, grid, args: tuple, kwargs: dict):
        if not self.fast:
            return self.fn[grid](*args, **kwargs)
        specs = tuple(_spec(a) for a in args)
        if None in specs or not all(isinstance(v, _PLAIN) for v in kwargs.values()):
            return self.fn[grid](*args, **kwargs)
        key = (specs, tuple(kwargs.items()), torch.cuda.current_device())
        kernel = self.compiled.get(key)
        if kernel is None:  # the JIT compiles (or finds) it and launches this call
            kernel = self.fn[grid](*args, **kwargs)
            self.compiled[key] = kernel
            return kernel
        rest = self.names[len(args) :]
        vals = (*args, *(kwargs[n] if n in kwargs else self.defaults[n] for n in rest))
        g = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        stream = torch.cuda.current_stream().cuda_stream
        meta = kernel.launch_metadata(g, stream, *vals)
        hooks = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        kernel.run(*g, stream, kernel.function, kernel.packed_metadata, meta, *hooks, *vals)
        return kernel
