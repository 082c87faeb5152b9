"""Where bytes live and how they move: byte ranges over files, mmap views, quantized weights.

`offload` knows byte ranges and residency, not file formats: GGUF semantics live in `engine.gguf`,
which hands `ByteRange`s down to this package.

The names below load on first use (PEP 562): `offload.residency` is plain Python that the CLI's
flag parsing reads, and importing the package must not pull in torch for `localllm --help`.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from localllm.offload.ranges import ByteRange, MappedFile
    from localllm.offload.weights import QuantWeight

_LAZY = {
    "ByteRange": "localllm.offload.ranges",
    "MappedFile": "localllm.offload.ranges",
    "QuantWeight": "localllm.offload.weights",
}

__all__ = ["ByteRange", "MappedFile", "QuantWeight"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
