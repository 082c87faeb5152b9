"""A lean parser of one GGUF container (v2/v3, little-endian), read straight from a mapped buffer.

Why not `gguf.GGUFReader`: it builds numpy views per array element, so a 262k-token vocabulary
takes ~20 s to open. Here a string array is one tight `struct.unpack_from` loop over a memoryview
and a numeric array is one `np.frombuffer`.

Layout (ggml docs/gguf.md): "GGUF", u32 version, u64 n_tensors, u64 n_kv; n_kv × (string key,
u32 value type, value); n_tensors × (string name, u32 n_dims, n_dims × u64 ne, u32 ggml type,
u64 offset); padding to `general.alignment` (default 32); tensor data. A string is a u64 byte
length then the bytes (no NUL). v2 and v3 share this layout (v3 only added big-endian files, which
we refuse; v1 had 32-bit lengths and is long gone).

Metadata values: scalars become int/float/bool/str; an array of strings a list[str]; an array of
numbers or bools a 1-D numpy array of the exact dtype (a copy, so it does not pin the mapping);
an array of arrays a list of those.

Strings: keys and tensor names must be valid UTF-8 (they are identifiers; invalid bytes mean
corruption). String *values* decode with errors="surrogateescape": llama.cpp keeps raw bytes and
some vocabularies hold byte tokens that are not valid UTF-8 alone. surrogateescape never fails,
gives exactly the strict result for valid text, and is lossless:
`value.encode("utf-8", "surrogateescape")` returns the stored bytes.

Every count and length is checked against the bytes left before anything is allocated, so a
corrupt header fails at once with a GGUFError instead of a MemoryError or a hang.
"""

import itertools
import struct
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np
from gguf import GGUFValueType as VT

from localllm.engine.gguf.errors import GGUFError
from localllm.kernels.quant import QuantType, block_geometry

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"
MAX_DIMS = 4  # GGML_MAX_DIMS
# Real files never nest arrays more than once; the cap keeps a corrupt file from recursing deep.
MAX_ARRAY_NESTING = 8
INT64_MAX = 2**63 - 1
# Smallest possible encodings, used to refuse absurd counts before looping or allocating:
# a KV is key length + type + at least a 1-byte value; a tensor info has a name length, n_dims,
# at least one ne, the type and the offset.
MIN_KV_BYTES = 8 + 4 + 1
MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
# value type -> (struct format of one scalar, numpy dtype of an array), both little-endian.
_FORMATS = {
    VT.UINT8: ("<B", "<u1"),
    VT.INT8: ("<b", "<i1"),
    VT.UINT16: ("<H", "<u2"),
    VT.INT16: ("<h", "<i2"),
    VT.UINT32: ("<I", "<u4"),
    VT.INT32: ("<i", "<i4"),
    VT.UINT64: ("<Q", "<u8"),
    VT.INT64: ("<q", "<i8"),
    VT.FLOAT32: ("<f", "<f4"),
    VT.FLOAT64: ("<d", "<f8"),
    VT.BOOL: ("<B", "<u1"),  # one byte; nonzero is true (as in llama.cpp)
}
_SCALAR = MappingProxyType({vt: struct.Struct(f) for vt, (f, _) in _FORMATS.items()})
_NUMERIC = MappingProxyType({vt: np.dtype(d) for vt, (_, d) in _FORMATS.items()})
_MIN_ELEMENT_BYTES = MappingProxyType(
    {**{vt: dt.itemsize for vt, dt in _NUMERIC.items()}, VT.STRING: 8, VT.ARRAY: 4 + 8}
)


@dataclass(frozen=True, slots=True)
class RawTensor:
    """One tensor info, validated: torch-order shape and absolute byte range in its file."""

    name: str
    qtype: QuantType
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class ParsedFile:
    """Everything the header of one GGUF file says."""

    path: str
    version: int
    metadata: dict[str, Any]
    tensors: list[RawTensor]
    alignment: int
    data_start: int


class _Cursor:
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


def _value_type(cur: _Cursor, raw: int, where: str) -> VT:
    try:
        return VT(raw)
    except ValueError:
        valid = ", ".join(f"{t.value}={t.name}" for t in VT)
        raise cur.error(f"unknown value type {raw} for {where} (expected one of {valid})") from None


def _read_value(cur: _Cursor, vt: VT, key: str, depth: int = 0) -> Any:
    if vt in _SCALAR:
        s = _SCALAR[vt]
        cur.need(s.size, f"the {vt.name} value of key {key!r}")
        cur.pos += s.size
        v = s.unpack_from(cur.buf, cur.pos - s.size)[0]
        return bool(v) if vt is VT.BOOL else v
    if vt is VT.STRING:
        return cur.string(f"the string value of key {key!r}", "surrogateescape")
    # An array: element type, length, then the elements (each nested array carries its own).
    at = cur.pos
    et = _value_type(cur, cur.u32(f"the array type of key {key!r}"), f"array elements of {key!r}")
    n = cur.u64(f"the array length of key {key!r}")
    cur.count(n, _MIN_ELEMENT_BYTES[et], f"array of {et.name} of key {key!r} at offset {at}")
    if et is VT.STRING:
        return _read_strings(cur, n, key)
    if et is VT.ARRAY:
        if depth + 1 >= MAX_ARRAY_NESTING:
            raise cur.error(
                f"arrays of key {key!r} nest deeper than {MAX_ARRAY_NESTING} levels at offset {at}"
            )
        return [_read_value(cur, VT.ARRAY, key, depth + 1) for _ in range(n)]
    dt = _NUMERIC[et]
    arr = np.frombuffer(cur.buf, dt, count=n, offset=cur.pos).copy() if n else np.empty(0, dt)
    cur.pos += n * dt.itemsize
    return arr.astype(np.bool_) if et is VT.BOOL else arr


def _read_strings(cur: _Cursor, n: int, key: str) -> list[str]:
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


def _read_header(cur: _Cursor) -> tuple[int, int, int]:
    if cur.size == 0:
        raise cur.error("empty file (0 bytes), expected a GGUF header")
    cur.need(4, "the magic")
    magic = bytes(cur.buf[:4])
    if magic != MAGIC:
        hint = "legacy GGML/GGJT model; re-convert it" if magic in (b"lmgg", b"tjgg") else ""
        raise cur.error(
            f"not a GGUF file: magic at offset 0 is {magic!r}, expected {MAGIC!r}"
            + (f" ({hint})" if hint else "")
        )
    cur.pos = 4
    version = cur.u32("the version")
    if version & 0xFFFF == 0 and version != 0:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        raise cur.error(f"big-endian GGUF (version {swapped}) is not supported")
    if version not in SUPPORTED_VERSIONS:
        raise cur.error(
            f"unsupported GGUF version {version} at offset 4 (supported: 2, 3)"
            + ("; version 1 files must be re-converted" if version == 1 else "")
        )
    n_tensors = cur.u64("the tensor count")
    n_kv = cur.u64("the metadata key/value count")
    return version, n_tensors, n_kv


def _read_metadata(cur: _Cursor, n_kv: int) -> dict[str, Any]:
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


def _alignment(cur: _Cursor, meta: dict[str, Any]) -> int:
    align = meta.get(ALIGNMENT_KEY, DEFAULT_ALIGNMENT)
    # llama.cpp stores it as u32; any integer is accepted, but it must be a power of two.
    if type(align) is not int or align <= 0 or align & (align - 1):
        raise cur.error(f"{ALIGNMENT_KEY} is {align!r}, expected a power-of-two integer")
    return align


def _read_tensor_info(cur: _Cursor, i: int, alignment: int) -> tuple[str, QuantType, list, int]:
    at = cur.pos
    name = cur.string(f"the name of tensor info #{i}")
    what = f"tensor info #{i} {name!r}"
    n_dims = cur.u32(f"n_dims of {what}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise cur.error(f"{what} at offset {at} has n_dims={n_dims}, expected 1..{MAX_DIMS}")
    cur.need(8 * n_dims, f"the dimensions of {what}")
    ne = list(struct.unpack_from(f"<{n_dims}Q", cur.buf, cur.pos))
    cur.pos += 8 * n_dims
    raw_type = cur.u32(f"the type of {what}")
    offset = cur.u64(f"the data offset of {what}")
    try:
        qtype = QuantType(raw_type)
    except ValueError:
        raise cur.error(f"{what} has unknown ggml type id {raw_type}") from None
    n_elements = 1
    for d in ne:
        n_elements *= d
    if min(ne) < 1 or max(ne) > INT64_MAX or n_elements > INT64_MAX:
        raise cur.error(f"{what} has dimensions ne={ne}: each must be 1..2^63-1, product too")
    block, _ = block_geometry(qtype)
    if ne[0] % block:
        raise cur.error(
            f"{what} ({qtype.name}) has rows of {ne[0]} elements, not a multiple of the "
            f"block size {block}"
        )
    if offset % alignment:
        raise cur.error(f"{what} has data offset {offset}, not a multiple of {alignment}")
    return name, qtype, ne, offset


def parse_gguf(path: str, buf: memoryview) -> ParsedFile:
    """Parse and validate the header of the GGUF file whose bytes are `buf` (named `path`)."""
    cur = _Cursor(path, buf)
    version, n_tensors, n_kv = _read_header(cur)
    meta = _read_metadata(cur, n_kv)
    alignment = _alignment(cur, meta)
    cur.count(n_tensors, MIN_TENSOR_INFO_BYTES, "the tensor count")
    infos, seen = [], set()
    for i in range(n_tensors):
        at = cur.pos
        info = _read_tensor_info(cur, i, alignment)
        if info[0] in seen:
            raise cur.error(f"duplicate tensor name {info[0]!r} at offset {at} (tensor #{i})")
        seen.add(info[0])
        infos.append(info)
    data_start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, qtype, ne, offset in infos:
        block, block_bytes = block_geometry(qtype)
        rows = 1
        for d in ne[1:]:
            rows *= d
        nbytes = rows * (ne[0] // block) * block_bytes
        start = data_start + offset
        if start + nbytes > cur.size:
            raise cur.error(
                f"tensor {name!r} data [{start}, {start + nbytes}) runs past the end of the file "
                f"({cur.size} bytes): truncated download?"
            )
        tensors.append(RawTensor(name, qtype, tuple(reversed(ne)), start, nbytes))
    _check_overlaps(cur, tensors)
    return ParsedFile(path, version, meta, tensors, alignment, data_start)


def _check_overlaps(cur: _Cursor, tensors: list[RawTensor]) -> None:
    ordered = sorted(tensors, key=lambda t: t.offset)
    for a, b in itertools.pairwise(ordered):
        if b.offset < a.offset + a.nbytes:
            raise cur.error(
                f"tensor {b.name!r} data starts at offset {b.offset}, inside tensor {a.name!r} "
                f"[{a.offset}, {a.offset + a.nbytes})"
            )
