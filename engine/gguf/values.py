"""Metadata values of a GGUF file, read through a bounds-checked cursor over its bytes.

Representation: scalars become int/float/bool/str; an array of strings a list[str]; an array of
numbers or bools a 1-D numpy array of the exact dtype (a copy, so it does not pin the mapping);
an array of arrays a list of those.

Strings: keys (and tensor names, read by parse.py) must be valid UTF-8: they are identifiers and
invalid bytes mean corruption. String *values* decode with errors="surrogateescape": llama.cpp
keeps raw bytes and some vocabularies hold byte tokens that are not valid UTF-8 alone.
surrogateescape never fails, gives exactly the strict result for valid text, and is lossless:
`value.encode("utf-8", "surrogateescape")` returns the stored bytes.

Every count and length is checked against the bytes left before anything is allocated, so a
corrupt header fails at once with a GGUFError instead of a MemoryError or a hang.
"""

import struct
from enum import IntEnum
from types import MappingProxyType
from typing import Any

import numpy as np

from localllm.engine.gguf.errors import GGUFError

# Real files never nest arrays more than once; the cap keeps a corrupt file from recursing deep.
MAX_ARRAY_NESTING = 8
# Smallest KV: key length + value type + a 1-byte value; used to refuse absurd counts.
MIN_KV_BYTES = 8 + 4 + 1


class ValueType(IntEnum):
    """Metadata value types, as `gguf.GGUFValueType` (a test checks they agree).

    Not imported from `gguf`: that package takes ~0.1 s to import, all of it cold-start time.
    """

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
# value type -> (struct format of one scalar, numpy dtype of an array), both little-endian.
_FORMATS = MappingProxyType(
    {
        ValueType.UINT8: ("<B", "<u1"),
        ValueType.INT8: ("<b", "<i1"),
        ValueType.UINT16: ("<H", "<u2"),
        ValueType.INT16: ("<h", "<i2"),
        ValueType.UINT32: ("<I", "<u4"),
        ValueType.INT32: ("<i", "<i4"),
        ValueType.UINT64: ("<Q", "<u8"),
        ValueType.INT64: ("<q", "<i8"),
        ValueType.FLOAT32: ("<f", "<f4"),
        ValueType.FLOAT64: ("<d", "<f8"),
        ValueType.BOOL: ("<B", "<u1"),  # one byte; nonzero is true (as in llama.cpp)
    }
)
_SCALAR = MappingProxyType({vt: struct.Struct(f) for vt, (f, _) in _FORMATS.items()})
_NUMERIC = MappingProxyType({vt: np.dtype(d) for vt, (_, d) in _FORMATS.items()})
_MIN_ELEMENT_BYTES = MappingProxyType(
    {
        **{vt: dt.itemsize for vt, dt in _NUMERIC.items()},
        ValueType.STRING: 8,
        ValueType.ARRAY: 4 + 8,
    }
)


class Cursor:
    """A read position over the file's bytes; every read is bounds-checked with a clear error."""

    __slots__ = ("buf", "path", "pos", "size")

    def __init__(self, path: str, buf: memoryview):
        self.path, self.buf, self.size, self.pos = path, buf, len(buf), 0

    def error(self, msg: str) -> GGUFError:
        return GGUFError(f"{self.path}: {msg}")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.error(
                f"truncated at offset {self.pos} while reading {what} (needed {n} bytes, "
                f"{self.size - self.pos} left; file is {self.size} bytes)"
            )

    def u32(self, what: str) -> int:
        self.need(4, what)
        self.pos += 4
        return _U32.unpack_from(self.buf, self.pos - 4)[0]

    def u64(self, what: str) -> int:
        self.need(8, what)
        self.pos += 8
        return _U64.unpack_from(self.buf, self.pos - 8)[0]

    def string(self, what: str, errors: str = "strict") -> str:
        n = self.u64(f"the length of {what}")
        self.need(n, what)
        start = self.pos
        self.pos += n
        try:
            return str(self.buf[start : self.pos], "utf-8", errors)
        except UnicodeDecodeError as e:
            raise self.error(
                f"{what} at offset {start} is not valid UTF-8 ({e.reason} at byte {e.start})"
            ) from None

    def count(self, n: int, min_each: int, what: str) -> None:
        """Refuse a count whose smallest possible encoding is longer than the rest of the file."""
        if n * min_each > self.size - self.pos:
            raise self.error(
                f"{what} claims {n} entries (at least {n * min_each} bytes) but only "
                f"{self.size - self.pos} bytes remain after offset {self.pos}: corrupt or truncated"
            )


def _value_type(cur: Cursor, raw: int, where: str) -> ValueType:
    try:
        return ValueType(raw)
    except ValueError:
        valid = ", ".join(f"{t.value}={t.name}" for t in ValueType)
        raise cur.error(f"unknown value type {raw} for {where} (expected one of {valid})") from None


def _read_value(cur: Cursor, vt: ValueType, key: str, depth: int = 0) -> Any:
    if vt in _SCALAR:
        s = _SCALAR[vt]
        cur.need(s.size, f"the {vt.name} value of key {key!r}")
        cur.pos += s.size
        v = s.unpack_from(cur.buf, cur.pos - s.size)[0]
        return bool(v) if vt is ValueType.BOOL else v
    if vt is ValueType.STRING:
        return cur.string(f"the string value of key {key!r}", "surrogateescape")
    # An array: element type, length, then the elements (each nested array carries its own).
    at = cur.pos
    et = _value_type(cur, cur.u32(f"the array type of key {key!r}"), f"array elements of {key!r}")
    n = cur.u64(f"the array length of key {key!r}")
    cur.count(n, _MIN_ELEMENT_BYTES[et], f"array of {et.name} of key {key!r} at offset {at}")
    if et is ValueType.STRING:
        return _read_strings(cur, n, key)
    if et is ValueType.ARRAY:
        if depth + 1 >= MAX_ARRAY_NESTING:
            raise cur.error(
                f"arrays of key {key!r} nest deeper than {MAX_ARRAY_NESTING} levels at offset {at}"
            )
        return [_read_value(cur, ValueType.ARRAY, key, depth + 1) for _ in range(n)]
    dt = _NUMERIC[et]
    arr = np.frombuffer(cur.buf, dt, count=n, offset=cur.pos).copy() if n else np.empty(0, dt)
    cur.pos += n * dt.itemsize
    return arr.astype(np.bool_) if et is ValueType.BOOL else arr


def _read_strings(cur: Cursor, n: int, key: str) -> list[str]:
    # The hot loop of a file open (262k tokens for Gemma 3): locals only, one check per element.
    buf, pos, size, unpack = cur.buf, cur.pos, cur.size, _U64.unpack_from
    out: list[str] = []
    append = out.append
    for i in range(n):
        end = pos + 8
        if end <= size:
            end += unpack(buf, pos)[0]
        if end > size:
            cur.pos = pos
            what = f"string {i} of the array of key {key!r}"
            cur.need(8, f"the length of {what}")
            cur.pos += 8
            cur.need(end - cur.pos, what)
        append(str(buf[pos + 8 : end], "utf-8", "surrogateescape"))
        pos = end
    cur.pos = pos
    return out


def read_metadata(cur: Cursor, n_kv: int) -> dict[str, Any]:
    cur.count(n_kv, MIN_KV_BYTES, "the metadata key/value count")
    meta: dict[str, Any] = {}
    for i in range(n_kv):
        at = cur.pos
        key = cur.string(f"metadata key #{i}")
        if key in meta:
            raise cur.error(f"duplicate metadata key {key!r} at offset {at} (key #{i})")
        vt = _value_type(cur, cur.u32(f"the value type of key {key!r}"), f"key {key!r}")
        meta[key] = _read_value(cur, vt, key)
    return meta
