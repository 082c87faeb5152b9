"""Host-tier experts computed by the GPU and the CPU together (`host_compute = split`).

Each decode token's k routed experts are shared out: the first k - c are read by the GPU in
place from page-locked host memory (`offload.mapped_experts`), the last c are computed by the
CPU's native kernels from the file's blocks, at the same time. Both pull expert bytes out of host
memory, so the bus's bandwidth and the CPU's add up; mapped alone leaves the CPU idle, the CPU
alone (llama.cpp's `-ot exps=CPU`) leaves the bus idle.

Per layer: the GPU copies the token rows and the CPU's share of the routing into page-locked
buffers and an event marks that; the GPU goes on to its share; the host waits for that event
alone, computes its share into a page-locked buffer, and the GPU work after it copies the sum in
and adds. In a decode graph chain (`engine.graph_breaks`) the event sits between two graphs
(`HostBreaks.fork`) and the host part is a host step; eagerly it is the same sequence.
"""

from collections.abc import Callable

import torch

from localllm.engine.graph_breaks import HostBreaks
from localllm.kernels.cpu.native import NativeKernels
from localllm.kernels.quant.types import QuantType

# Share of each token's routed experts the CPU computes. H200 host (16 cores): one expert over
# the bus ~61 us, on the CPU's native kernels ~80 us (RESULTS "Mapped host experts"), so ~3 of 8
SPLIT_CPU_SHARE = 0.375
SPLIT_MAX_T = 8  # token rows per step that split (decode); prompts read every expert over the bus

GpuPart = Callable[[torch.Tensor, object, torch.Tensor, torch.Tensor], torch.Tensor]


def cpu_count(n_used: int, share: float | None = None) -> int:
    """How many of a token's `n_used` experts the CPU takes (`share` of them, default
    SPLIT_CPU_SHARE): at least one, at most all but one."""
    share = SPLIT_CPU_SHARE if share is None else share
    return min(n_used - 1, max(1, round(n_used * share)))


class SplitExperts:
    """One layer's CPU side: its raw expert blocks (gate / up [E, hidden, rb], down [E, dim, rb]
    on the host), the native kernels, and the page-locked buffers of one step."""

    def __init__(
        self,
        native: NativeKernels,
        blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        types: tuple[QuantType, QuantType, QuantType],
        act: str,
        dim: int,
        n_used: int,
        share: float | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.native, self.act, self.types = native, act, types
        self.blocks = tuple(b.contiguous() for b in blocks)
        self.n_used, self.cpu = n_used, cpu_count(n_used, share)
        self.host_rows = 0  # token rows whose CPU share ran (replays included)
        pin = device is not None and device.type == "cuda"
        t, c = SPLIT_MAX_T, self.cpu

        def buf(*shape: int, dtype=torch.float32) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, pin_memory=pin)

        self._rows, self._y = buf(t, dim), buf(t, dim)
        self._w, self._ids = buf(t, c), buf(t, c, dtype=torch.int64)

    def takes(self, ids: torch.Tensor) -> bool:
        return 0 < ids.shape[0] <= SPLIT_MAX_T and ids.shape[1] == self.n_used

    def ffn(
        self,
        x: torch.Tensor,
        xq,
        weights: torch.Tensor,
        ids: torch.Tensor,
        gpu: GpuPart,
        breaks: HostBreaks | None = None,
    ) -> torch.Tensor:
        """x [T, dim], routing [T, k] -> float32 [T, dim]: `gpu(x, xq, weights, ids)` computes
        the first k - c experts of each token (the weighted sum of its pairs), the CPU the
        rest; `breaks`: the graph chain being captured, or None (eager)."""
        t, k = ids.shape
        g = k - self.cpu
        rows, w, cids, y = self._rows[:t], self._w[:t], self._ids[:t], self._y[:t]
        rows.copy_(x, non_blocking=True)
        w.copy_(weights[:, g:], non_blocking=True)
        cids.copy_(ids[:, g:], non_blocking=True)
        ready = _Ready(x.device) if breaks is None else breaks.fork()
        # (one token's slices are contiguous already: no copy kernel in decode)
        yg = gpu(x, xq, weights[:, :g].contiguous(), ids[:, :g].contiguous())

        def step() -> None:
            ready.synchronize()  # the rows and routing are here; the GPU's share runs on
            self.host_rows += t
            y.copy_(self._cpu(rows, w, cids))

        if breaks is None:
            step()
        else:
            breaks.host(step)
        return yg + y.to(x.device, non_blocking=True)

    def _cpu(self, rows: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        g, u, d = self.blocks
        return self.native.moe_ffn_fetched(
            rows, w, ids, lambda es: [(g[e], u[e], d[e]) for e in es], self.types, self.act
        )


class _Ready:
    """Eager form of a fork's event: recorded on the current stream now (CPU tensors: no-op)."""

    def __init__(self, device: torch.device) -> None:
        self.event = None
        if device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record()

    def synchronize(self) -> None:
        if self.event is not None:
            self.event.synchronize()
