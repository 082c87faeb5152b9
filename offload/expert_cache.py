"""Where MoE expert weights come from at compute time: resident slices or a streamed slot pool.

An `ExpertSource` answers `fetch(layer, expert)` with that expert's raw ggml blocks. Resident
experts (device or host tier) are slices of the loaded [n_expert, rows, row_bytes] tensors.
Disk-tier experts are never kept: `StreamedExperts` preads an expert's three contiguous slices
from the GGUF into one of a fixed number of slots on a miss, evicting the least recently used
one, and optionally asks the kernel to read ahead the experts the next layer used last time.
"""

import os
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from localllm.kernels.moe import ExpertBlocks
from localllm.offload.ranges import ByteRange


@dataclass(slots=True)
class ExpertStats:
    """Counters of one expert source; `hits + misses == lookups` always."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    stall_seconds: float = 0.0  # time compute waited on reads (misses)
    prefetched: int = 0  # experts hinted for read-ahead
    host_rows: int = 0  # token rows whose routed experts ran on the host (host compute)

    @property
    def read_gbps(self) -> float:
        """Read bandwidth seen by misses, in GB/s (0 before any read)."""
        return self.bytes_read / self.stall_seconds / 1e9 if self.stall_seconds > 0 else 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def snapshot(self) -> "ExpertStats":
        return replace(self)


class ExpertSource(Protocol):
    stats: ExpertStats

    def fetch(self, layer: int, expert: int) -> ExpertBlocks: ...

    def routed(self, layer: int, ids: torch.Tensor) -> None:
        """The experts `layer` is about to use (a hint for prefetching later layers)."""


class ResidentExperts:
    """Experts held in memory: per layer the (gate, up, down) raw tensors [n_expert, rows, rb]."""

    def __init__(self, layers: Mapping[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
        self.layers = dict(layers)
        self.stats = ExpertStats()

    def fetch(self, layer: int, expert: int) -> ExpertBlocks:
        self.stats.lookups += 1
        self.stats.hits += 1
        g, u, d = self.layers[layer]
        return ExpertBlocks(g[expert], u[expert], d[expert])

    def routed(self, layer: int, ids: torch.Tensor) -> None:
        pass


@dataclass(frozen=True, slots=True)
class ExpertLayout:
    """One layer's three expert tensors in the file: whole-tensor byte ranges and the uint8
    shape [rows, row_bytes] of one expert's slice of each."""

    n_expert: int
    ranges: tuple[ByteRange, ByteRange, ByteRange]  # gate, up, down
    shapes: tuple[tuple[int, int], tuple[int, int], tuple[int, int]]

    def __post_init__(self):
        for rng, (rows, rb) in zip(self.ranges, self.shapes, strict=True):
            if rng.nbytes != self.n_expert * rows * rb:
                raise ValueError(f"{rng}: not {self.n_expert} experts of {rows}x{rb} bytes")

    @property
    def expert_nbytes(self) -> int:
        return sum(rows * rb for rows, rb in self.shapes)

    def expert_ranges(self, expert: int) -> list[ByteRange]:
        out = []
        for rng, (rows, rb) in zip(self.ranges, self.shapes, strict=True):
            n = rows * rb
            out.append(ByteRange(rng.path, rng.offset + expert * n, n))
        return out


@dataclass(slots=True)
class _Slots:
    lru: OrderedDict = field(default_factory=OrderedDict)  # (layer, expert) -> slot, oldest first
    free: list[int] = field(default_factory=list)


class StreamedExperts:
    """Disk-tier experts read on demand into `slots` fixed buffers with LRU eviction.

    The pool is allocated once (slots x the largest expert), so memory stays bounded whatever
    the routing does; blocks handed out by `fetch` stay valid until the next `fetch`.
    """

    def __init__(self, layouts: Mapping[int, ExpertLayout], slots: int, prefetch: bool = False):
        if slots < 1:
            raise ValueError("expert streaming needs at least one slot")
        self.layouts = dict(layouts)
        self.slot_bytes = max(lay.expert_nbytes for lay in self.layouts.values())
        self.n_slots, self.prefetch = slots, prefetch
        self.pool = torch.empty(slots, self.slot_bytes, dtype=torch.uint8)
        self._views = [memoryview(self.pool[i].numpy()) for i in range(slots)]
        self._slots = _Slots(free=list(range(slots - 1, -1, -1)))
        self._last_used: dict[int, list[int]] = {}  # layer -> experts it used last time
        self._fds: dict[str, int] = {}
        self.stats = ExpertStats()

    @property
    def nbytes(self) -> int:
        return self.pool.numel()

    def _fd(self, path: str) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    def _read(self, slot: int, layout: ExpertLayout, expert: int) -> None:
        t0 = time.perf_counter()
        pos, view = 0, self._views[slot]
        for rng in layout.expert_ranges(expert):
            fd, done = self._fd(rng.path), 0
            while done < rng.nbytes:  # pread may return short counts
                n = os.preadv(fd, [view[pos + done : pos + rng.nbytes]], rng.offset + done)
                if n <= 0:
                    raise OSError(f"{rng.path}: unexpected end of file reading an expert")
                done += n
            pos += rng.nbytes
        self.stats.stall_seconds += time.perf_counter() - t0
        self.stats.bytes_read += pos

    def fetch(self, layer: int, expert: int) -> ExpertBlocks:
        s, key, layout = self._slots, (layer, expert), self.layouts[layer]
        self.stats.lookups += 1
        slot = s.lru.get(key)
        if slot is not None:
            s.lru.move_to_end(key)
            self.stats.hits += 1
        else:
            self.stats.misses += 1
            slot = s.free.pop() if s.free else s.lru.popitem(last=False)[1]
            s.lru[key] = slot
            self._read(slot, layout, expert)
        parts, pos = [], 0
        for rows, rb in layout.shapes:
            parts.append(self.pool[slot, pos : pos + rows * rb].view(rows, rb))
            pos += rows * rb
        return ExpertBlocks(*parts)

    def routed(self, layer: int, ids: torch.Tensor) -> None:
        self._last_used[layer] = torch.unique(ids).tolist()
        if not self.prefetch or not hasattr(os, "posix_fadvise"):
            return
        nxt = layer + 1
        if nxt not in self.layouts:
            return
        # Experts repeat across consecutive tokens: read ahead what the next layer used last
        # step. The kernel fills its page cache in the background; our memory does not grow.
        for e in self._last_used.get(nxt, ()):
            if (nxt, e) in self._slots.lru:
                continue
            for rng in self.layouts[nxt].expert_ranges(e):
                os.posix_fadvise(self._fd(rng.path), rng.offset, rng.nbytes, os.POSIX_FADV_WILLNEED)
            self.stats.prefetched += 1

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self):
        self.close()
