"""`NativeKernels.moe_ffn` for a decode step's few token rows, prepared once per layer.

A decode step's routed experts run once per layer per token: `moe_ffn`'s ~20 torch ops (grouping
the pairs by expert, index tensors, fresh buffers) cost ~0.2 ms a layer on a 2-core Xeon, a
quarter of the kernels' own time. Here the indices are made once and the buffers come from a
scratch the model's layers share; a call builds three arrays of expert addresses and makes the
two C calls. Each (token, expert) pair is its own group, in the routing's order: a pair's output
does not depend on its group (the kernels' row dots give every row the same bits whatever shares
the decode), so the result equals `moe_ffn`'s bit for bit.
"""

import ctypes

import torch

from localllm.kernels.cpu.native import ACTS, NativeKernels, quant_buffers
from localllm.kernels.quant.types import QuantType


class RowsScratch:
    """Buffers of `RowsCall`s run one at a time (the layers of one model share one): each named
    buffer is grown to the largest call seen."""

    def __init__(self) -> None:
        self._bufs: dict[str, tuple] = {}

    def get(self, name: str, n: int, make) -> tuple:
        """The buffers `make(n)` made under `name`, remade when a call needs more than n."""
        have = self._bufs.get(name)
        if have is None or have[0] < n:
            have = self._bufs[name] = (n, make(n))
        return have[1]


class RowsCall:
    """Experts gate / up [E, hidden, rb], down [E, dim, rb] (contiguous host tensors) for up to
    `max_rows` token rows of `k` pairs each; `run` reads and writes float32 buffers by address
    (page-locked ones a GPU copies from and to), `__call__` takes and returns tensors."""

    def __init__(
        self,
        native: NativeKernels,
        blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        types: tuple[QuantType, QuantType, QuantType],
        act: str,
        max_rows: int,
        k: int,
        scratch: RowsScratch | None = None,
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
        self.two = q4[0] != q4[1]  # gate and up read x in two formats
        self.scratch = scratch or RowsScratch()

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: list[int]) -> torch.Tensor:
        """x [t, dim], weights [t, k] (CPU), expert ids (t * k, row-major: the caller has them
        as a list already) -> float32 [t, dim]."""
        x, w = x.float().contiguous(), weights.float().contiguous()
        y = torch.empty(x.shape[0], self.dim)
        self.run(x.shape[0], x.data_ptr(), w.data_ptr(), ids, y.data_ptr(), torch.get_num_threads())
        return y

    def takes(self, ids: torch.Tensor) -> bool:
        return ids.shape[0] <= self.max_rows and ids.shape[1] == self.k

    def run(self, t: int, x_ptr: int, w_ptr: int, ids: list[int], y_ptr: int, threads: int):
        """Rows x [t, dim] at `x_ptr`, weights [t, k] at `w_ptr`, expert ids (t * k, row-major)
        -> y [t, dim] at `y_ptr` (float32, contiguous)."""
        n, e = len(ids), self.blocks[0].shape[0]
        if not 0 < t <= self.max_rows or n != t * self.k or not 0 <= min(ids) <= max(ids) < e:
            raise ValueError(f"bad routing for {t} rows of {self.k} of {e} experts: {ids}")
        arr = ctypes.c_void_p * n
        addr = [arr(*(b + i * s for i in ids)) for b, s in zip(self.base, self.stride, strict=True)]
        ptr = torch.Tensor.data_ptr
        sc, dim, hid = self.scratch, self.dim, self.hidden
        x8 = sc.get("x8", t * dim, quant_buffers)
        k8 = sc.get("k8", t * dim, quant_buffers) if self.two else x8
        a8 = sc.get("a8", n * hid, quant_buffers)
        h = sc.get("h", n * 2 * hid, torch.empty)
        dn = sc.get("dn", n * dim, torch.empty)
        lib = self.native.lib
        lib.moe_pairs(
            t, n, ptr(self.gstart), *addr, ptr(self.tok), x_ptr, *self.types, dim, hid,
            self.act, *(ptr(b) for b in x8), *(ptr(b) for b in k8), ptr(h),
            *(ptr(b) for b in a8), ptr(dn), threads,
        )  # fmt: skip
        lib.moe_combine(t, self.k, ptr(self.pos), w_ptr, ptr(dn), dim, y_ptr, threads)
