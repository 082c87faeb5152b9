"""Byte ranges over files and zero-copy views of them through a shared read-only mmap."""

import mmap
import os
from dataclasses import dataclass

import torch

# Page-size advice for every file mapping: True asks the kernel for 2 MiB pages (MADV_HUGEPAGE:
# what it reads from now on comes in 2 MiB folios mapped by one TLB entry each, so the decode
# step's weight stream misses the TLB 512x less often; no copy, no extra memory), False forbids
# them (4 KiB entries: the A/B baseline), None leaves the kernel's choice. A silent no-op where
# the platform has no such advice (macOS, Windows, kernels without transparent huge pages).
# Pages already cached in small folios stay small: see docs/residency.md. None (the kernel's
# choice, as before) until a quiet 2-thread A/B and a memory-pressure check of mapped experts:
# measured so far at one thread on a busy box only (tests/perf/results/cpu.md, 15:54-16:17 UTC).
HUGE_PAGES: bool | None = None


@dataclass(frozen=True, slots=True)
class ByteRange:
    """A contiguous run of bytes in a file: where a tensor's data lives on disk."""

    path: str
    offset: int
    nbytes: int


class MappedFile:
    """A read-only mmap of one file that hands out zero-copy uint8 tensors over byte ranges."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            self.size = os.fstat(f.fileno()).st_size
            # A private (copy-on-write) map: torch wants a writable buffer, and a stray write
            # could never reach the file. Pages stay shared with the page cache until written.
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if self.size else None
        # before the first read of the mapping: the advice shapes the folios the reads bring in
        self.huge_pages = _advise_pages(self._mm, HUGE_PAGES)
        self._buf = memoryview(self._mm) if self._mm is not None else memoryview(bytearray())

    def buffer(self) -> memoryview:
        return self._buf

    def view(self, rng: ByteRange) -> torch.Tensor:
        """A uint8 tensor aliasing `rng` in the mapped file (no copy)."""
        if rng.path != self.path:
            raise ValueError(f"range belongs to {rng.path}, not {self.path}")
        if rng.offset < 0 or rng.offset + rng.nbytes > self.size:
            raise ValueError(
                f"{self.path}: byte range [{rng.offset}, {rng.offset + rng.nbytes}) "
                f"is outside the file ({self.size} bytes)"
            )
        if rng.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self._buf, dtype=torch.uint8, count=rng.nbytes, offset=rng.offset)

    def advise(self, rng: ByteRange, huge: bool) -> bool:
        """Page-size advice for the whole pages inside `rng` alone, where the mapping took
        `HUGE_PAGES` advice; whether the kernel took it."""
        if self._mm is None or self.huge_pages is None or rng.path != self.path:
            return False
        start = -(-rng.offset // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (rng.offset + rng.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        advice = getattr(mmap, "MADV_HUGEPAGE" if huge else "MADV_NOHUGEPAGE", None)
        if end <= start or advice is None:
            return False
        try:
            self._mm.madvise(advice, start, end - start)
        except OSError:
            return False
        return True

    def advise_willneed(self) -> None:
        if self._mm is not None and hasattr(self._mm, "madvise"):
            self._mm.madvise(mmap.MADV_WILLNEED)


def _advise_pages(mm: mmap.mmap | None, huge: bool | None) -> bool | None:
    """Apply `HUGE_PAGES` advice to a mapping: the advice the kernel took, or None where none
    was asked, the platform has no such advice, or the kernel refused it (no THP: EINVAL)."""
    name = {True: "MADV_HUGEPAGE", False: "MADV_NOHUGEPAGE"}.get(huge)
    advice = getattr(mmap, name, None) if name else None
    if mm is None or advice is None or not hasattr(mm, "madvise"):
        return None
    try:
        mm.madvise(advice)
    except OSError:
        return None
    return huge
