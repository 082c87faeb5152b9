"""Disk-tier experts of a GPU model whose misses the CPU computes (`[streaming] misses = "cpu"`).

A decode step's (token, expert) pairs whose expert a device slot holds are computed there by the
resident kernels over the slot pool; the others are computed at the same time by the CPU's native
kernels straight from the file's blocks (the mapping: page cache, or the disk), as llama.cpp
computes the layers it keeps on the CPU. No miss waits for a read: the most used missed experts
are read into slots after the step, at most ADMIT_SHARE reads per miss (`StreamedExperts.admit`).

Per layer: the GPU copies the token rows and the routing into page-locked buffers; a host step
waits for them, looks the experts up and writes each pair's slot and weight (0 for a miss) for
the GPU; the GPU's grouped GEMVs over the slots run while a second host step computes the misses
into a page-locked buffer, which the GPU then copies in and adds. In a decode graph chain
(`engine.graph_breaks`) both steps are host steps between graphs; eagerly, the same sequence.
"""

import time
from collections.abc import Callable

import torch

from localllm.engine.graph_breaks import HostBreaks
from localllm.kernels.cpu.native import NativeKernels
from localllm.kernels.cpu.rows_call import RowsCall, RowsScratch
from localllm.kernels.quant.types import QuantType

HYBRID_MAX_T = 8  # token rows per step computed this way (decode); prompts read misses into slots

GpuPart = Callable[[torch.Tensor, object, torch.Tensor, torch.Tensor], torch.Tensor]


class HybridExperts:
    """One disk-tier layer: `source` (a `StreamedExperts` with a packed device pool) says which
    experts its slots hold; the native kernels over the file's blocks (gate / up [E, hidden,
    rb], down [E, dim, rb] host tensors over the mapping) compute the others."""

    def __init__(
        self,
        native: NativeKernels,
        blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        types: tuple[QuantType, QuantType, QuantType],
        act: str,
        dim: int,
        n_used: int,
        source,
        layer: int,
        device: torch.device,
        scratch: RowsScratch | None = None,
        threads: int | None = None,
    ) -> None:
        """`scratch`: buffers shared with the model's other layers (one step at a time);
        `threads`: the CPU's threads (None: torch's thread count)."""
        self.call = RowsCall(native, blocks, types, act, HYBRID_MAX_T, n_used, scratch)
        self.source, self.layer, self.n_used, self.threads = source, layer, n_used, threads
        pin = device.type == "cuda"
        t, k = HYBRID_MAX_T, n_used

        def host(*shape: int, dtype=torch.float32) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, pin_memory=pin)

        self._rows, self._y = host(t, dim), host(t, dim)
        self._w, self._ids = host(t, k), host(t, k, dtype=torch.int64)
        self._gw, self._gs = host(t, k), host(t, k, dtype=torch.int64)
        # what the GPU's part reads (static: a captured graph reads them at every replay)
        self._gw_dev = torch.zeros(t, k, device=device)
        self._gs_dev = torch.zeros(t, k, dtype=torch.int64, device=device)
        self._y_dev = torch.zeros(t, dim, device=device)
        self._dirty = False  # _y_dev holds a step's CPU rows (zeroed before a step without)
        self._misses: list[tuple[int, int, float]] = []  # (row, expert, weight), step to step
        self._missed: list[int] = []

    def takes(self, ids: torch.Tensor) -> bool:
        return 0 < ids.shape[0] <= HYBRID_MAX_T and ids.shape[1] == self.n_used

    def ffn(
        self,
        x: torch.Tensor,
        xq,
        weights: torch.Tensor,
        ids: torch.Tensor,
        gpu: GpuPart,
        breaks: HostBreaks | None = None,
    ) -> torch.Tensor:
        """x [T, dim], routing [T, k] -> float32 [T, dim]: `gpu(x, xq, weights, slots)` computes
        the pairs the slots hold (the others weigh 0), the CPU the rest; `breaks`: the graph
        chain being captured, or None (eager)."""
        t = ids.shape[0]
        self._rows[:t].copy_(x, non_blocking=True)
        self._w[:t].copy_(weights, non_blocking=True)
        self._ids[:t].copy_(ids, non_blocking=True)
        run = breaks.host if breaks is not None else (lambda step: step())
        run(lambda: self._assign(t, x.device))
        yg = gpu(x, xq, self._gw_dev[:t], self._gs_dev[:t])
        run(lambda: self._misses_on_cpu(t))
        return yg + self._y_dev[:t]

    def _assign(self, t: int, device: torch.device) -> None:
        """Host step 1: the rows and routing are here; each pair gets its slot and weight."""
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        k = self.n_used
        ids = self._ids[:t].reshape(-1).tolist()
        w = self._w[:t].reshape(-1).tolist()
        experts = sorted(set(ids))
        slot = dict(zip(experts, self.source.held(self.layer, experts), strict=True))
        # a missed pair reads a slot the step reads anyway (its weight 0 adds exactly nothing)
        some = next((s for s in slot.values() if s is not None), 0)
        gs, gw, self._misses = [], [], []
        for p, (e, wt) in enumerate(zip(ids, w, strict=True)):
            s = slot[e]
            gs.append(some if s is None else s)
            gw.append(wt if s is not None else 0.0)
            if s is None:
                self._misses.append((p // k, e, wt))
        self._missed = [e for e in experts if slot[e] is None]
        self._gs[:t] = torch.tensor(gs, dtype=torch.int64).view(t, k)
        self._gw[:t] = torch.tensor(gw, dtype=torch.float32).view(t, k)
        self._gs_dev[:t].copy_(self._gs[:t], non_blocking=True)
        self._gw_dev[:t].copy_(self._gw[:t], non_blocking=True)

    def _misses_on_cpu(self, t: int) -> None:
        """Host step 2 (the GPU's part runs meanwhile): the misses from the file's blocks, then
        the most used of them read into slots."""
        if self._misses:
            t0 = time.perf_counter()
            threads = self.threads or torch.get_num_threads()
            self.call.run_pairs(t, self._rows.data_ptr(), self._misses, self._y.data_ptr(), threads)
            self._y_dev[:t].copy_(self._y[:t], non_blocking=True)
            self._dirty = True
            st = self.source.stats
            st.cpu_pairs += len(self._misses)
            st.cpu_seconds += time.perf_counter() - t0
        elif self._dirty:
            self._y_dev.zero_()
            self._dirty = False
        if self._missed:
            self.source.admit(self.layer, self._missed)
