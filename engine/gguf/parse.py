"""A lean parser of one GGUF container (v2/v3, little-endian), read straight from a mapped buffer.

Why not `gguf.GGUFReader`: it builds numpy views per array element, so a 262k-token vocabulary
takes ~20 s to open. Here a string array is one tight `struct.unpack_from` loop over a memoryview
and a numeric array is one `np.frombuffer`.

Layout (ggml docs/gguf.md): "GGUF", u32 version, u64 n_tensors, u64 n_kv; n_kv × (string key,
u32 value type, value); n_tensors × (string name, u32 n_dims, n_dims × u64 ne, u32 ggml type,
u64 offset); padding to `general.alignment` (default 32); tensor data. A string is a u64 byte
length then the bytes (no NUL). v2 and v3 share this layout (v3 only added big-endian files, which
we refuse; v1 had 32-bit lengths and is long gone).

Metadata values and strings: see values.py.

Every count and length is checked against the bytes left before anything is allocated, so a
corrupt header fails at once with a GGUFError instead of a MemoryError or a hang.
"""

import itertools
import struct
from dataclasses import dataclass
from typing import Any

from localllm.engine.gguf.values import Cursor, read_metadata
from localllm.kernels.quant import QuantType, block_geometry

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"
MAX_DIMS = 4  # GGML_MAX_DIMS
INT64_MAX = 2**63 - 1
# Smallest tensor info (name length, n_dims, one ne, type, offset): refuses absurd counts early.
MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8


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


def _read_header(cur: Cursor) -> tuple[int, int, int]:
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


def _alignment(cur: Cursor, meta: dict[str, Any]) -> int:
    align = meta.get(ALIGNMENT_KEY, DEFAULT_ALIGNMENT)
    # llama.cpp stores it as u32; any integer is accepted, but it must be a power of two.
    if type(align) is not int or align <= 0 or align & (align - 1):
        raise cur.error(f"{ALIGNMENT_KEY} is {align!r}, expected a power-of-two integer")
    return align


def _read_tensor_info(cur: Cursor, i: int, alignment: int) -> tuple[str, QuantType, list, int]:
    at = cur.pos
    name = cur.string(f"the name of tensor info #{i}")
    what = f"tensor info #{i} {name!r}"
    n_dims = cur.u32(f"n_dims of {what}")
    what += f" at offset {at}"  # validation errors below also say where the info starts
    if not 1 <= n_dims <= MAX_DIMS:
        raise cur.error(f"{what} has n_dims={n_dims}, expected 1..{MAX_DIMS}")
    cur.need(8 * n_dims, f"the dimensions of {what}")
    ne = list(struct.unpack_from(f"<{n_dims}Q", cur.buf, cur.pos))
    cur.pos += 8 * n_dims
    raw_type = cur.u32(f"the type of {what}")
    offset = cur.u64(f"the data offset of {what}")
    try:
        qtype = QuantType(raw_type)
    except ValueError:
        raise cur.error(
            f"{what} has unknown ggml type id {raw_type} (corrupt, or a type newer than this "
            "reader knows)"
        ) from None
    n_elements = 1
    for d in ne:
        n_elements *= d
    if min(ne) < 1 or max(ne) > INT64_MAX or n_elements > INT64_MAX:
        raise cur.error(
            f"{what} has dimensions ne={ne}, expected each and their product in 1..2^63-1"
        )
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
    cur = Cursor(path, buf)
    version, n_tensors, n_kv = _read_header(cur)
    meta = read_metadata(cur, n_kv)
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


def _check_overlaps(cur: Cursor, tensors: list[RawTensor]) -> None:
    ordered = sorted(tensors, key=lambda t: t.offset)
    for a, b in itertools.pairwise(ordered):
        if b.offset < a.offset + a.nbytes:
            raise cur.error(
                f"tensor {b.name!r} data starts at offset {b.offset}, inside tensor {a.name!r} "
                f"[{a.offset}, {a.offset + a.nbytes})"
            )
