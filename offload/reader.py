"""Plain reads of byte ranges into private memory (the `read` load mode, and tests)."""

import os

import torch

from localllm.offload.ranges import ByteRange


def read_range(rng: ByteRange) -> torch.Tensor:
    """The bytes of `rng` as a new uint8 tensor, read with pread (no mapping of the file)."""
    out = torch.empty(rng.nbytes, dtype=torch.uint8)
    view, done = memoryview(out.numpy()), 0
    fd = os.open(rng.path, os.O_RDONLY)
    try:
        while done < rng.nbytes:
            n = os.preadv(fd, [view[done:]], rng.offset + done)
            if n <= 0:
                raise OSError(f"{rng.path}: unexpected end of file at {rng.offset + done}")
            done += n
    finally:
        os.close(fd)
    return out
