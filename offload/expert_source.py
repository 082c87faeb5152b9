"""What an MoE layer asks of its experts' home (`ExpertSource`), where a layer's experts sit in
the file (`ExpertLayout`), and the source of experts held in memory (`ResidentExperts`).

An `ExpertSource` answers `fetch(layer, expert)` with that expert's raw ggml blocks, or, for
experts computed on the CPU, its `PreparedExpert` (weights prepared once by `prepare_expert`,
the same form in every mode, so greedy output does not depend on residency). Resident experts
(device or host tier) are slices of the loaded [n_expert, rows, row_bytes] tensors; the disk
tier's source is `offload.expert_cache.StreamedExperts`.
"""

import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

import torch

from localllm.kernels.moe import ExpertBlocks, ExpertFormat
from localllm.kernels.moe.prepared import PreparedExpert, prepare_expert
from localllm.kernels.quant.types import row_nbytes
from localllm.offload.expert_stats import ExpertStats
from localllm.offload.ranges import ByteRange


class ExpertSource(Protocol):
    stats: ExpertStats

    def fetch(self, layer: int, expert: int) -> ExpertBlocks | PreparedExpert: ...

    def fetch_together(self, layer: int, experts: list[int]) -> list[ExpertBlocks]:
        """Raw blocks of `experts` (one layer's, after `routed`), all valid at once; at most
        `together` of them (None: no limit)."""

    together: int | None

    def routed(self, layer: int, ids: torch.Tensor) -> None:
        """The experts `layer` is about to use (they must stay while it computes)."""

    def guess(self, layer: int, experts: list[int]) -> None:
        """Experts `layer` will probably use, best first (a prefetch hint)."""

    def drain(self) -> None:
        """Wait for reads in flight (before a CUDA graph is captured)."""


PREPARE_THREADS = 8  # threads preparing resident experts at load


class IgnoresHints:
    """`ExpertSource`'s routing, prefetch and drain calls as no-ops, for sources that hold what
    they serve (or whose reads a GPU asks for)."""

    def routed(self, layer: int, ids: torch.Tensor) -> None:
        pass

    def guess(self, layer: int, experts: list[int]) -> None:
        pass

    def drain(self) -> None:
        pass


class ResidentExperts(IgnoresHints):
    """Experts held in memory: per layer the (gate, up, down) raw tensors [n_expert, rows, rb].

    The layers in `prepared` (layer -> its ExpertFormat) whose tensors are on the CPU get every
    expert prepared here, once; `fetch` then answers with the PreparedExpert. Other layers
    answer with raw blocks (a device computes them, or a device copy is made of them). With
    `lazy`, an expert is prepared on its first fetch instead (a default source that a residency
    plan may replace before any use costs nothing). `native`: the native CPU kernels, whose block
    linears then take the prepared matrices of the types they know (`prepare_expert`).
    """

    def __init__(
        self,
        layers: Mapping[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        prepared: Mapping[int, ExpertFormat] = MappingProxyType({}),
        lazy: bool = False,
        native=None,
    ):
        self.layers = dict(layers)
        self.native = native  # the native CPU kernels the prepared experts may run on
        self.formats: dict[int, ExpertFormat] = {}
        self.prepared: dict[int, list[PreparedExpert | None]] = {}
        todo = []
        for layer, fmt in dict(prepared).items():
            if layer not in self.layers:
                raise ValueError(f"layer {layer} to prepare has no resident experts")
            if self.layers[layer][0].device.type == "cpu":
                self.formats[layer] = fmt
                self.prepared[layer] = [None] * self.layers[layer][0].shape[0]
                todo += [(layer, e) for e in range(len(self.prepared[layer]))]
        if todo and not lazy:  # torch ops release the GIL: a big model prepares on every core
            with ThreadPoolExecutor(min(PREPARE_THREADS, os.cpu_count() or 1)) as pool:
                list(pool.map(lambda key: self._prepare(*key), todo))
        self.stats = ExpertStats()

    @property
    def nbytes(self) -> int:
        """Bytes the prepared experts hold beyond the raw tensors (which the model holds)."""
        return sum(p.nbytes for ps in self.prepared.values() for p in ps if p is not None)

    def _prepare(self, layer: int, expert: int) -> PreparedExpert:
        g, u, d = self.layers[layer]
        blocks = ExpertBlocks(g[expert], u[expert], d[expert])
        p = prepare_expert(blocks, self.formats[layer], native=self.native)
        self.prepared[layer][expert] = p
        return p

    together = None

    def fetch_together(self, layer: int, experts: list[int]) -> list[ExpertBlocks]:
        g, u, d = self.layers[layer]
        self.stats.lookups += len(experts)
        self.stats.hits += len(experts)
        return [ExpertBlocks(g[e], u[e], d[e]) for e in experts]

    def fetch(self, layer: int, expert: int) -> ExpertBlocks | PreparedExpert:
        self.stats.lookups += 1
        self.stats.hits += 1
        prepared = self.prepared.get(layer)
        if prepared is not None:
            return prepared[expert] or self._prepare(layer, expert)
        g, u, d = self.layers[layer]
        return ExpertBlocks(g[expert], u[expert], d[expert])


@dataclass(frozen=True, slots=True)
class ExpertLayout:
    """One layer's three expert tensors in the file: whole-tensor byte ranges and the uint8
    shape [rows, row_bytes] of one expert's slice of each; `fmt` (their types and FFN sizes)
    is needed only to prepare streamed experts for CPU compute."""

    n_expert: int
    ranges: tuple[ByteRange, ByteRange, ByteRange]  # gate, up, down
    shapes: tuple[tuple[int, int], tuple[int, int], tuple[int, int]]
    fmt: ExpertFormat | None = None

    def __post_init__(self):
        for rng, (rows, rb) in zip(self.ranges, self.shapes, strict=True):
            if rng.nbytes != self.n_expert * rows * rb:
                raise ValueError(f"{rng}: not {self.n_expert} experts of {rows}x{rb} bytes")
        f = self.fmt
        if f is not None:
            d, h = f.dim, f.hidden
            want = (
                (h, row_nbytes(f.gate, d)),
                (h, row_nbytes(f.up, d)),
                (d, row_nbytes(f.down, h)),
            )
            if tuple(map(tuple, self.shapes)) != want:
                raise ValueError(f"expert shapes {self.shapes} do not match {f} ({want})")

    @property
    def expert_nbytes(self) -> int:
        return sum(rows * rb for rows, rb in self.shapes)

    def expert_ranges(self, expert: int) -> list[ByteRange]:
        out = []
        for rng, (rows, rb) in zip(self.ranges, self.shapes, strict=True):
            n = rows * rb
            out.append(ByteRange(rng.path, rng.offset + expert * n, n))
        return out
