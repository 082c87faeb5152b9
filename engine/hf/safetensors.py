"""One `.safetensors` file over an mmap: its header parsed and checked, tensors as zero-copy views.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
[begin, end) data offsets; an optional `__metadata__` of strings), then the data. We read it
ourselves over `offload.MappedFile` rather than through `safetensors.safe_open` so every tensor
keeps a `ByteRange` (residency accounting, like a GGUF tensor) and a hostile header fails with one
line: a header larger than the file or than `MAX_HEADER`, offsets outside the data or overlapping,
a byte count that is not shape x dtype size.
"""

import itertools
import json
import math
import os
import stat
from dataclasses import dataclass

import torch

from localllm.offload import ByteRange, MappedFile

MAX_HEADER = 100 << 20  # the safetensors library's own limit on the JSON header (100 MB)

# safetensors dtype -> (torch dtype, bytes per element)
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "F64": (torch.float64, 8),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
}


class SafetensorsError(ValueError):
    """A safetensors file that cannot be read (the message names the file)."""


@dataclass(frozen=True)
class StTensor:
    """One tensor of a safetensors file: its dtype name, torch-order shape and bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    range: ByteRange


class SafetensorsFile:
    """A mapped safetensors file; `tensors` in header order, `view(name)` without a copy."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            st = os.stat(self.path)
        except OSError as e:
            raise SafetensorsError(f"{self.path}: cannot open ({e.strerror})") from None
        if not stat.S_ISREG(st.st_mode):
            raise SafetensorsError(f"{self.path}: not a regular file")
        try:
            self._file = MappedFile(self.path)
        except (OSError, ValueError) as e:
            raise SafetensorsError(f"{self.path}: cannot map ({e})") from None
        self.metadata: dict[str, str] = {}
        self.tensors: dict[str, StTensor] = self._parse(self._file.buffer())

    def _parse(self, buf: memoryview) -> dict[str, StTensor]:
        size = len(buf)
        if size < 8:
            raise SafetensorsError(f"{self.path}: {size} bytes, too short for a safetensors file")
        n = int.from_bytes(buf[:8], "little")
        if n > MAX_HEADER or 8 + n > size:
            raise SafetensorsError(
                f"{self.path}: header of {n} bytes does not fit the file of {size} bytes "
                f"(at most {MAX_HEADER}): truncated or not a safetensors file"
            )
        try:
            header = json.loads(bytes(buf[8 : 8 + n]))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsError(f"{self.path}: the header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{self.path}: the header is not a JSON object")
        meta = header.pop("__metadata__", None) or {}
        if isinstance(meta, dict):
            self.metadata = {str(k): str(v) for k, v in meta.items()}
        base, data_size = 8 + n, size - 8 - n
        out: dict[str, StTensor] = {}
        spans = []
        for name, entry in header.items():
            t = _entry(self.path, name, entry, data_size)
            spans.append((*t, name))
            begin, end, dtype, shape = t
            out[name] = StTensor(
                name, dtype, shape, ByteRange(self.path, base + begin, end - begin)
            )
        spans.sort()
        for (_, end_a, *_, a), (begin_b, *_, b) in itertools.pairwise(spans):
            if begin_b < end_a:
                raise SafetensorsError(f"{self.path}: tensors {a!r} and {b!r} overlap")
        return out

    def view(self, name: str) -> torch.Tensor:
        """The tensor in its stored dtype and shape, aliasing the mapping (a copy only when
        its offset is not aligned to its element size, which torch's views need)."""
        t = self.tensors[name]
        raw = self._file.view(t.range)
        dtype, width = DTYPES[t.dtype]
        if t.range.offset % width:
            raw = raw.clone()
        return raw.view(dtype).reshape(t.shape)

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's bytes as uint8 [*shape[:-1], row bytes] (a view of the mapping)."""
        t = self.tensors[name]
        width = DTYPES[t.dtype][1]
        lead = t.shape[:-1] if t.shape else ()
        row = (t.shape[-1] if t.shape else 1) * width
        return self._file.view(t.range).reshape(*lead, row)


def _entry(path: str, name: str, entry, data_size: int) -> tuple[int, int, str, tuple[int, ...]]:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise SafetensorsError(f"{where}: header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPES:
        raise SafetensorsError(f"{where}: unsupported dtype {dtype!r}")
    ok_shape = isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
    if not ok_shape:
        raise SafetensorsError(f"{where}: shape {shape!r} is not a list of sizes")
    ok_offsets = (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(type(o) is int for o in offsets)
        and 0 <= offsets[0] <= offsets[1] <= data_size
    )
    if not ok_offsets:
        raise SafetensorsError(
            f"{where}: data offsets {offsets!r} are outside the {data_size} data bytes "
            "(a truncated file?)"
        )
    nbytes = math.prod(shape) * DTYPES[dtype][1]
    if offsets[1] - offsets[0] != nbytes:
        raise SafetensorsError(
            f"{where}: {offsets[1] - offsets[0]} bytes for shape {tuple(shape)} of {dtype} "
            f"({nbytes} expected)"
        )
    return offsets[0], offsets[1], dtype, tuple(shape)
