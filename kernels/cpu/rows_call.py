"""`NativeKernels.moe_ffn` for a decode step's few token rows, prepared once per layer.

A decode step's host experts run once per layer per token: `moe_ffn`'s ~20 torch ops (grouping
the pairs by expert, index tensors, fresh buffers) would cost more than a quarter of the
kernels' own time there. Here every buffer and index is made once; a call builds three arrays of
expert addresses and makes the two C calls. Each (token, expert) pair is its own group, in the
routing's order: a pair's output does not depend on its group (the kernels' row dots give every
row the same bits whatever shares the decode), so the result equals `moe_ffn`'s bit for bit.
"""

import ctypes

import torch

from localllm.kernels.cpu.native import ACTS, NativeKernels, quant_buffers
from localllm.kernels.quant.types import QuantType


class RowsCall:
    """Experts gate / up [E, hidden, rb], down [E, dim, rb] (contiguous host tensors) for up to
    `max_rows` token rows of `k` pairs each; `run` reads and writes caller-owned float32 buffers
    by address (page-locked ones a GPU copies from and to)."""

    def __init__(
        self,
        native: NativeKernels,
        blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        types: tuple[QuantType, QuantType, QuantType],
        act: str,
        max_rows: int,
        k: int,
    ) -> None:
        self.native, self.k, self.max_rows = native, k, max_rows
        self.blocks = tuple(b.contiguous() for b in blocks)  # kept: the addresses point in
        self.base = [b.data_ptr() for b in self.blocks]
        self.stride = [b.stride(0) * b.element_size() for b in self.blocks]
        self.types, self.act = tuple(int(QuantType(t)) for t in types), ACTS[act]
        self.hidden, self.dim = self.blocks[0].shape[1], self.blocks[2].shape[1]
        pairs = max_rows * k
        self.gstart = torch.arange(pairs + 1, dtype=torch.int64)
        self.tok = torch.arange(pairs, dtype=torch.int64) // k  # pair p reads row p // k
        self.pos = torch.arange(pairs, dtype=torch.int64)
        q4 = [t == QuantType.Q4_K for t in types[:2]]
        self.x8 = quant_buffers(max_rows * self.dim)
        self.k8 = quant_buffers(max_rows * self.dim) if q4[0] != q4[1] else self.x8
        self.h = torch.empty(pairs * 2 * self.hidden)
        self.a8 = quant_buffers(pairs * self.hidden)
        self.dn = torch.empty(pairs * self.dim)
        self._keep = (self.x8, self.k8, self.a8)

    def run(self, t: int, x_ptr: int, w_ptr: int, ids: list[int], y_ptr: int, threads: int):
        """Rows x [t, dim] at `x_ptr`, weights [t, k] at `w_ptr`, expert ids (t * k, row-major)
        -> y [t, dim] at `y_ptr` (float32, contiguous)."""
        n, e = len(ids), self.blocks[0].shape[0]
        if not 0 < t <= self.max_rows or n != t * self.k or not 0 <= min(ids) <= max(ids) < e:
            raise ValueError(f"bad routing for {t} rows of {self.k} of {e} experts: {ids}")
        arr = ctypes.c_void_p * n
        addr = [arr(*(b + e * s for e in ids)) for b, s in zip(self.base, self.stride, strict=True)]
        ptr = torch.Tensor.data_ptr
        lib = self.native.lib
        lib.moe_pairs(
            t, n, ptr(self.gstart), *addr, ptr(self.tok), x_ptr, *self.types, self.dim,
            self.hidden, self.act, *(ptr(b) for b in self.x8), *(ptr(b) for b in self.k8),
            ptr(self.h), *(ptr(b) for b in self.a8), ptr(self.dn), threads,
        )  # fmt: skip
        lib.moe_combine(t, self.k, ptr(self.pos), w_ptr, ptr(self.dn), self.dim, y_ptr, threads)
