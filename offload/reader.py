"""Plain reads of byte ranges into private memory: the `read` load mode, and the expert
streamer's preads, cut into one contiguous share per reading thread."""

import os

import torch

from localllm.offload.ranges import ByteRange

# no thread's share is smaller: a share handed to a pool thread costs ~20-40 us of Python and a
# wake-up; a 3 MB expert cut in 8 (~380 KB each) read at 5.4 GB/s against 26 GB/s for 96 experts
# at once (H200 host, page cache, 01:59 UTC)
READ_SHARE_MIN = 1 << 20


def read_range(rng: ByteRange) -> torch.Tensor:
    """The bytes of `rng` as a new uint8 tensor, read with pread (no mapping of the file)."""
    out = torch.empty(rng.nbytes, dtype=torch.uint8)
    fd = os.open(rng.path, os.O_RDONLY)
    try:
        pread_exact(fd, memoryview(out.numpy()), rng.offset, rng.path)
    finally:
        os.close(fd)
    return out


def shares(segments: list[tuple], parts: int) -> list[list[tuple]]:
    """Reads (fd, view, offset, path) cut into `parts` lists of about equal bytes, in order."""
    total = sum(len(v) for _, v, _, _ in segments)
    size = -(-total // max(1, min(parts, total // READ_SHARE_MIN)))
    out, cur, room = [], [], size
    for fd, view, off, path in segments:
        pos = 0
        while pos < len(view):
            n = min(room, len(view) - pos)
            cur.append((fd, view[pos : pos + n], off + pos, path))
            pos, room = pos + n, room - n
            if room == 0:
                out.append(cur)
                cur, room = [], size
    if cur:
        out.append(cur)
    return out


def pread_all(reads: list[tuple]) -> None:
    """Every read (fd, view, offset, path) of a list, in order."""
    for read in reads:
        pread_exact(*read)


def pread_exact(fd: int, view: memoryview, offset: int, path: str) -> None:
    """Fill `view` from `offset` of the open file (pread may return short counts)."""
    done = 0
    while done < len(view):  # pread may return short counts
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"{path}: unexpected end of file at {offset + done}")
        done += n
