"""QuantWeight: a weight kept in its on-disk ggml encoding (raw blocks), not expanded to float."""

from dataclasses import dataclass

import torch

from localllm.kernels.quant import QuantType, block_geometry
from localllm.offload.ranges import ByteRange


@dataclass(frozen=True, slots=True)
class QuantWeight:
    """Raw ggml blocks of one tensor.

    `shape` is the logical torch shape (outermost first, so GGUF's ne reversed); `data` is uint8
    with the same leading dims and the last dim in bytes. `source` says where the bytes came from,
    so residency code can re-read or stream them.
    """

    data: torch.Tensor
    qtype: QuantType
    shape: tuple[int, ...]
    source: ByteRange | None = None

    def __post_init__(self):
        block, nbytes = block_geometry(self.qtype)
        if self.data.dtype != torch.uint8:
            raise TypeError(f"QuantWeight data must be uint8, got {self.data.dtype}")
        if self.shape[-1] % block:
            raise ValueError(f"{self.qtype.name}: row of {self.shape[-1]} is not whole blocks")
        expected = (*self.shape[:-1], self.shape[-1] // block * nbytes)
        if tuple(self.data.shape) != expected:
            raise ValueError(f"raw data shape {tuple(self.data.shape)} != {expected}")

    @property
    def nbytes(self) -> int:
        return self.data.numel()
