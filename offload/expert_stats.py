"""Counters of MoE expert sources: lookups, hits and misses, reads, stalls, prefetch guesses,
host-computed rows; what `bench`, `/metrics`, `run --stats` and the TUI's memory view show."""

from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from typing import Protocol


@dataclass(slots=True)
class ExpertStats:
    """Counters of one expert source; `hits + misses == lookups` always."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    stall_seconds: float = 0.0  # time compute waited on reads (misses, unfinished read-aheads)
    read_seconds: float = 0.0  # time reads took, in the foreground or on the prefetch thread
    prefetched: int = 0  # experts read ahead on a guess
    prefetch_hits: int = 0  # lookups served by a read-ahead
    guessed: int = 0  # experts guessed for a coming layer (prefetch)
    guessed_right: int = 0  # of those, the ones the layer then routed to
    host_rows: int = 0  # token rows whose routed experts ran on the host (host compute)
    cpu_pairs: int = 0  # split: (token, expert) pairs the CPU computed beside the device (hits)
    prepared: int = 0  # experts prepared for CPU compute after a read (streamed sources)
    prepare_seconds: float = 0.0  # time those preparations took (in the reads' thread)

    @property
    def read_gbps(self) -> float:
        """Bandwidth of the expert reads, in GB/s (0 before any read)."""
        return self.bytes_read / self.read_seconds / 1e9 if self.read_seconds > 0 else 0.0

    @property
    def guess_rate(self) -> float:
        """Share of the prefetch's guessed experts that the layer then used."""
        return self.guessed_right / self.guessed if self.guessed else 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def snapshot(self) -> "ExpertStats":
        return replace(self)


class Counted(Protocol):
    """Anything that keeps `ExpertStats`: the expert sources (`offload.expert_source`)."""

    stats: ExpertStats


def expert_stats(sources: Iterable[Counted]) -> ExpertStats:
    """Counters summed over the sources (hits + misses = lookups)."""
    total = ExpertStats()
    for s in sources:
        for f in fields(ExpertStats):
            setattr(total, f.name, getattr(total, f.name) + getattr(s.stats, f.name))
    return total
