"""Reader for CTranslate2 `model.bin` files (binary version 6, as faster-whisper ships them).

Layout (little endian): u32 version, str spec name, u32 revision, u32 n_vars, then per variable
str name, u8 rank, u32 dims, u8 dtype, u32 nbytes, raw bytes; then u32 n_aliases, (str, str).
A str is u16 length (with its NUL) + bytes. Tensors are zero-copy views of a memory map.
"""

import mmap
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# CTranslate2's DataType enum order.
_DTYPES = (torch.float32, torch.int8, torch.int16, torch.int32, torch.float16, torch.bfloat16)
SUPPORTED_VERSIONS = (5, 6)


class CT2FormatError(ValueError):
    """The file is not a CTranslate2 model.bin this reader understands (or is truncated)."""


@dataclass(frozen=True)
class CT2Model:
    """The spec name and revision, and every variable by name (aliases resolved)."""

    spec: str
    revision: int
    tensors: dict[str, torch.Tensor]


class _Cursor:
    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise CT2FormatError(f"{self.path}: truncated at byte {self.pos} (wanted {n} more)")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> int:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("H")
        if n == 0:
            raise CT2FormatError(f"{self.path}: zero-length string at byte {self.pos}")
        return bytes(self.take(n)[:-1]).decode("utf-8", errors="replace")


def view_bytes(
    raw: memoryview | np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """A tensor over read-only mapped bytes, without a copy (the weights are never written)."""
    arr = np.frombuffer(raw, dtype=np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable array": intended here
        return torch.from_numpy(arr).view(dtype).reshape(shape)


def read_ct2(path: str | Path) -> CT2Model:
    """Parse `path` (a model.bin) into tensors backed by a read-only memory map."""
    path = Path(path)
    if path.is_dir():
        path = path / "model.bin"
    with path.open("rb") as f:
        size = path.stat().st_size
        if size < 8:
            raise CT2FormatError(f"{path}: too small to be a CTranslate2 model ({size} bytes)")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(memoryview(mm), path)
    version = cur.unpack("I")
    if version not in SUPPORTED_VERSIONS:
        raise CT2FormatError(f"{path}: CTranslate2 binary version {version} is not supported")
    spec = cur.string()
    revision = cur.unpack("I")
    tensors: dict[str, torch.Tensor] = {}
    for _ in range(cur.unpack("I")):
        name = cur.string()
        shape = tuple(cur.unpack("I") for _ in range(cur.unpack("B")))
        code = cur.unpack("B")
        if code >= len(_DTYPES):
            raise CT2FormatError(f"{path}: {name}: unknown dtype code {code}")
        dtype = _DTYPES[code]
        nbytes = cur.unpack("I")
        count = int(np.prod(shape)) if shape else 1
        if nbytes != count * dtype.itemsize:
            raise CT2FormatError(f"{path}: {name}: {nbytes} bytes do not fit {shape} {dtype}")
        tensors[name] = view_bytes(cur.take(nbytes), dtype, shape)
    for _ in range(cur.unpack("I")):
        alias, target = cur.string(), cur.string()
        if target not in tensors:
            raise CT2FormatError(f"{path}: alias {alias} points to missing {target}")
        tensors[alias] = tensors[target]
    return CT2Model(spec, revision, tensors)
