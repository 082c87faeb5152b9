"""Where bytes live and how they move: byte ranges over files, mmap views, quantized weights.

`offload` knows byte ranges and residency, not file formats: GGUF semantics live in `engine.gguf`,
which hands `ByteRange`s down to this package.
"""

from localllm.offload.ranges import ByteRange, MappedFile
from localllm.offload.weights import QuantWeight

__all__ = ["ByteRange", "MappedFile", "QuantWeight"]
