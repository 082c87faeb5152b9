"""Host-tier experts computed by the GPU and the CPU together (`host_compute = split`).

Each decode token's k routed experts are shared out: the first k - c are read by the GPU in
place from page-locked host memory (`offload.mapped_experts`), the last c are computed by the
CPU's native kernels from the file's blocks, at the same time. Both pull expert bytes out of host
memory, so the bus's bandwidth and the CPU's add up; mapped alone leaves the CPU idle, the CPU
alone (llama.cpp's `-ot exps=CPU`) leaves the bus idle.

Where the GPU's share has device slots over it (`--expert-slots`), each token's experts the
slots do not hold are moved to its end first, so the CPU takes misses that would cross the bus
and the GPU the hits it reads from its own memory.

Per layer: the GPU copies the token rows and the CPU's share of the routing into page-locked
buffers and an event marks that; the GPU goes on to its share; the host waits for that event
alone, computes its share into a page-locked buffer, and the GPU work after it copies the sum in
and adds. A captured decode step is one graph where every other layer allows it: the hand-over
is then a pair of flags in host memory (`engine.moe.split_link`), and the host runs the CPU's
shares beside the replay. In a decode graph chain (`engine.runtime.graph_breaks`: other layers
need host steps) the event sits between two graphs (`HostBreaks.fork`) and the host part is a
host step; eagerly it is the same sequence.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from localllm.engine.runtime.graph_breaks import HostBreaks
from localllm.kernels.cpu.native import NativeKernels
from localllm.kernels.cpu.rows_call import RowsCall, RowsScratch
from localllm.kernels.quant.types import QuantType
from localllm.offload.mapped import host_view, map_empty

# Share of each token's routed experts the CPU computes: 5 of 8 was the fastest of 4 to 6 of 8
# (69.14 / 67.16 t/s against 62.34 at 4 and 58.63 at 6) once the hand-over took flags in one
# graph and one native call (`engine.moe.split_link`; H200 box, 16 cores, RESULTS "Split layers in
# one graph"); with graph breaks and a Python loop, 3 of 8 had been the fastest
SPLIT_CPU_SHARE = 0.625
# with device slots over the GPU's share the bus carries only its misses and the CPU's share is
# the longer side: 2 of 8 decoded 1.2x 3 of 8 over 512 slots through LLM.generate (H200; equal
# under `localllm bench`, RESULTS "Every expert on host beside llama.cpp at its footprints")
SPLIT_CPU_SHARE_SLOTS = 0.25
SPLIT_MAX_T = 8  # token rows per step that split (decode); prompts read every expert over the bus
SPLIT_THREADS: int | None = None  # CPU threads of the host share (None: torch's thread count)

GpuPart = Callable[[torch.Tensor, object, torch.Tensor, torch.Tensor], torch.Tensor]


def cpu_count(n_used: int, share: float | None = None, layer: int = 0) -> int:
    """How many of a token's `n_used` experts the CPU takes in `layer`: `share` of them
    (default SPLIT_CPU_SHARE), a fraction of an expert as the layers alternate (3.5 of 8: 3, 4,
    3, 4, ...); at least one, at most all but one."""
    share = SPLIT_CPU_SHARE if share is None else share
    c = round(n_used * share * (layer + 1), 6) // 1 - round(n_used * share * layer, 6) // 1
    return min(n_used - 1, max(1, int(c)))


@dataclass
class SplitTiming:
    """A layer's host steps: how long the host waited for the token rows, how long the CPU's
    share took, and in how many steps the GPU's share was still running when the CPU's was done
    (mostly: the bus is the bottleneck, give the CPU more; rarely: the CPU is; counted at graph
    breaks and eagerly: a linked graph counts the GPU's waits instead, `SplitLink.gpu_waits`)."""

    steps: int = 0
    wait_seconds: float = 0.0
    cpu_seconds: float = 0.0
    gpu_busy: int = 0


class SplitExperts:
    """One layer's CPU side: the native kernels prepared over its raw expert blocks (gate / up
    [E, hidden, rb], down [E, dim, rb] on the host; `kernels.cpu.rows_call`), the page-locked
    buffers of one step, and counters (`host_rows`, `timing`)."""

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
        layer: int = 0,
        scratch: RowsScratch | None = None,
    ) -> None:
        """`scratch`: buffers shared with the model's other split layers (one step at a time)."""
        self.n_used, self.cpu = n_used, cpu_count(n_used, share, layer)
        self.call = RowsCall(native, blocks, types, act, SPLIT_MAX_T, self.cpu, scratch)
        # the GPU's slot map (expert -> slot, -1: not on the device) where its share is cached:
        # each token's uncached experts then go last, to the CPU, before the bus
        self.slot_of: torch.Tensor | None = None
        self.host_rows = 0  # token rows whose CPU share ran (replays included)
        self.stats = None  # an `ExpertStats`: the CPU's pairs count as hits, its rows as host rows
        self.timing = SplitTiming()
        t, c, f32 = SPLIT_MAX_T, self.cpu, torch.float32
        spec = {"rows": ((t, dim), f32), "y": ((t, dim), f32), "w": ((t, c), f32)}
        spec["ids"] = ((t, c), torch.int64)
        # on CUDA the buffers are mapped: a linked graph's kernels store and load them in place
        # (`kernels.host_flags.hand_out`), copies at graph breaks and eagerly use the host views
        self.mapped: dict[str, torch.Tensor] | None = None
        if device is not None and device.type == "cuda":
            self.mapped = map_empty(spec, device)
            bufs = {k: host_view(v) for k, v in self.mapped.items()}
        else:
            bufs = {k: torch.empty(shape, dtype=dt) for k, (shape, dt) in spec.items()}
        self._rows, self._y, self._w, self._ids = (bufs[k] for k in ("rows", "y", "w", "ids"))

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
        link=None,
    ) -> torch.Tensor:
        """x [T, dim], routing [T, k] -> float32 [T, dim]: `gpu(x, xq, weights, ids)` computes
        the first k - c experts of each token (the weighted sum of its pairs), the CPU the
        rest; `breaks`: the graph chain being captured, `link`: the one graph being captured
        (`engine.moe.split_link`), or neither (eager)."""
        t, k = ids.shape
        g = k - self.cpu
        if self.slot_of is not None:  # (a stable sort: hits, then misses, each in routing order)
            miss = (self.slot_of[ids] < 0).to(torch.int8)
            order = torch.sort(miss, dim=1, stable=True).indices
            ids, weights = ids.gather(1, order), weights.gather(1, order)
        if link is not None:  # rows out and the host's flag, the GPU's share, the wait and sum
            i = link.hand_out(self, x, weights, ids, g)
            yg = gpu(x, xq, weights[:, :g].contiguous(), ids[:, :g].contiguous())
            return link.take_back(i, yg)
        rows, w, cids, y = self._rows[:t], self._w[:t], self._ids[:t], self._y[:t]
        rows.copy_(x, non_blocking=True)
        w.copy_(weights[:, g:], non_blocking=True)
        cids.copy_(ids[:, g:], non_blocking=True)
        ready = _Ready(x.device) if breaks is None else breaks.fork()
        # (one token's slices are contiguous already: no copy kernel in decode)
        yg = gpu(x, xq, weights[:, :g].contiguous(), ids[:, :g].contiguous())

        def step() -> None:
            t0 = time.perf_counter()
            ready.synchronize()  # the rows and routing are here; the GPU's share runs on
            self.cpu_step(t, time.perf_counter() - t0)
            busy = x.is_cuda and not torch.cuda.current_stream(x.device).query()
            self.timing.gpu_busy += busy

        if breaks is None:
            step()
        else:
            breaks.host(step)
        return yg + y.to(x.device, non_blocking=True)

    def cpu_step(self, t: int, waited: float) -> None:
        """The CPU's share of `t` token rows from the page-locked buffers into `_y` (the GPU's
        copies out are done); `waited`: seconds the host waited for them."""
        t1 = time.perf_counter()
        ids = self._ids[:t].reshape(-1).tolist()
        threads = SPLIT_THREADS or torch.get_num_threads()
        rows, w, y = (b.data_ptr() for b in (self._rows, self._w, self._y))
        self.call.run(t, rows, w, ids, y, threads)
        self.count(t, waited, time.perf_counter() - t1)

    def count(self, t: int, waited: float, computing: float) -> None:
        """A step's CPU share of `t` rows ran: its counters and timing."""
        tm = self.timing
        tm.steps, self.host_rows = tm.steps + 1, self.host_rows + t
        if self.stats is not None:
            self.stats.host_rows += t
            self.stats.cpu_pairs += t * self.cpu
            self.stats.lookups += t * self.cpu
            self.stats.hits += t * self.cpu
        tm.wait_seconds += waited
        tm.cpu_seconds += computing


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
