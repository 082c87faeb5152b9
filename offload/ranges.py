"""Byte ranges over files and zero-copy views of them through a shared read-only mmap."""

import mmap
import os
from dataclasses import dataclass

import torch


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

    def advise_willneed(self) -> None:
        if self._mm is not None and hasattr(self._mm, "madvise"):
            self._mm.madvise(mmap.MADV_WILLNEED)
