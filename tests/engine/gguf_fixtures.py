"""Helpers to write GGUF files for tests: a `gguf.GGUFWriter` wrapper and a raw byte builder.

`write_gguf` makes well-formed files through the reference writer. The `raw_*` helpers build
files byte by byte, for layouts the reference writer refuses to produce (bad types, huge counts,
overlapping tensors, v2 headers, ...). Import as `from tests.engine.gguf_fixtures import ...`.
"""

import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGUFValueType as VT
from gguf.gguf_writer import GGUFValue

from localllm.engine.gguf import GGUFModel
from localllm.kernels.quant import QuantType, block_geometry
from localllm.offload import ByteRange

__all__ = [
    "GGUFValue",
    "assert_matches_reader",
    "f32_tensor_info",
    "random_blocks",
    "raw_gguf",
    "raw_kv",
    "raw_string",
    "raw_tensor_info",
    "write_gguf",
]

_NP_TO_VT = {
    np.dtype(np.uint8): VT.UINT8,
    np.dtype(np.int8): VT.INT8,
    np.dtype(np.uint16): VT.UINT16,
    np.dtype(np.int16): VT.INT16,
    np.dtype(np.uint32): VT.UINT32,
    np.dtype(np.int32): VT.INT32,
    np.dtype(np.uint64): VT.UINT64,
    np.dtype(np.int64): VT.INT64,
    np.dtype(np.float32): VT.FLOAT32,
    np.dtype(np.float64): VT.FLOAT64,
    np.dtype(np.bool_): VT.BOOL,
}


def _add_metadata(w: gguf.GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, GGUFValue):
        w.add_key_value(key, value.value, value.type, value.sub_type)
    elif isinstance(value, np.ndarray):
        w.add_key_value(key, value.tolist(), VT.ARRAY, _NP_TO_VT[value.dtype])
    elif isinstance(value, np.generic):
        w.add_key_value(key, value.item(), _NP_TO_VT[value.dtype])
    elif isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_int64(key, value) if not -(2**31) <= value < 2**31 else w.add_int32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, list):
        w.add_array(key, value)
    else:
        raise TypeError(f"cannot write metadata {key!r} of type {type(value)}")


def write_gguf(
    path: str | Path,
    metadata: dict[str, Any] | None = None,
    tensors: dict[str, Any] | None = None,
    *,
    arch: str | None = "llama",
    alignment: int | None = None,
    split_max_tensors: int = 0,
) -> Path:
    """Write a GGUF file with gguf.GGUFWriter; return its path (the first shard if split).

    metadata values: a GGUFValue for an exact type, a numpy array or scalar (typed by dtype), or
    a plain bool/int/float/str/list (int32 or int64, float32). tensors values: a float/int numpy
    array (F32, F16, ...), or `(raw uint8 blocks, qtype, torch shape)` for quantized data.
    `arch=None` leaves out general.architecture.
    """
    path = Path(path)
    w = gguf.GGUFWriter(path, arch or "none", split_max_tensors=split_max_tensors)
    if arch is None:
        del w.kv_data[0][gguf.Keys.General.ARCHITECTURE]
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, value in (metadata or {}).items():
        _add_metadata(w, key, value)
    for name, t in (tensors or {}).items():
        if isinstance(t, tuple):
            raw, qtype, shape = t
            block, nbytes = block_geometry(qtype)
            byte_shape = (*shape[:-1], shape[-1] // block * nbytes)
            raw = np.asarray(raw, dtype=np.uint8).reshape(byte_shape)
            w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType(int(qtype)))
        else:
            w.add_tensor(name, np.ascontiguousarray(t))
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if len(w.tensors) > 1:
        return path.with_name(f"{path.stem}-00001-of-{len(w.tensors):05d}.gguf")
    return path


def random_blocks(qtype: QuantType, shape: tuple[int, ...], seed: int = 0):
    """`(raw uint8 blocks, qtype, shape)` of random bytes, a quantized tensor for write_gguf."""
    block, nbytes = block_geometry(qtype)
    n = int(np.prod(shape[:-1])) * shape[-1] // block * nbytes
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8), qtype, shape


def raw_string(s: str | bytes) -> bytes:
    """A GGUF string: u64 byte length then the bytes."""
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def raw_kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    """One metadata entry: key, u32 value type, then the already-encoded value."""
    return raw_string(key) + struct.pack("<I", vtype) + payload


def raw_tensor_info(name: str | bytes, ne: list[int], qtype: int, offset: int) -> bytes:
    """One tensor info: name, n_dims, ne (GGUF order, innermost first), ggml type, data offset."""
    return (
        raw_string(name)
        + struct.pack(f"<I{len(ne)}Q", len(ne), *ne)
        + struct.pack("<IQ", qtype, offset)
    )


def raw_gguf(
    kvs: list[bytes] = (),
    infos: list[bytes] = (),
    data: bytes = b"",
    *,
    version: int = 3,
    n_tensors: int | None = None,
    n_kv: int | None = None,
    alignment: int = 32,
) -> bytes:
    """A whole file from parts; counts default to the number of parts given."""
    head = b"GGUF" + struct.pack(
        "<IQQ",
        version,
        len(infos) if n_tensors is None else n_tensors,
        len(kvs) if n_kv is None else n_kv,
    )
    body = head + b"".join(kvs) + b"".join(infos)
    pad = -len(body) % alignment if infos else 0
    return body + b"\0" * pad + data


def f32_tensor_info(name: str, n: int, offset: int) -> bytes:
    """Shorthand used by the error tests: a 1-D F32 tensor of n elements."""
    return raw_tensor_info(name, [n], int(QuantType.F32), offset)


def _reader_value(field):
    """gguf.GGUFReader's field as our representation (flat arrays only)."""
    main = field.types[0]
    if main is VT.STRING:
        return bytes(field.parts[-1]).decode("utf-8")
    if main is not VT.ARRAY:
        v = field.parts[-1].tolist()[0]
        return bool(v) if main is VT.BOOL else v
    assert len(field.types) == 2, "nested arrays are compared separately"
    if field.types[1] is VT.STRING:
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    return np.concatenate([field.parts[i] for i in field.data]) if field.data else None


def _assert_same_value(ours, ref, key):
    if isinstance(ref, np.ndarray):
        assert isinstance(ours, np.ndarray), key
        assert ours.ndim == 1 and ours.dtype == ref.dtype.newbyteorder("="), key
        np.testing.assert_array_equal(ours, ref, err_msg=key)
    else:
        assert type(ours) is type(ref) and ours == ref, (key, ours, ref)


def assert_matches_reader(model: GGUFModel, path, ref: gguf.GGUFReader | None = None):
    """Every metadata value and tensor info of `model` equals what gguf.GGUFReader reports."""
    ref = ref or gguf.GGUFReader(path)
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert list(model.metadata) == keys
    for key in keys:
        field = ref.fields[key]
        if field.types[0] is VT.ARRAY and len(field.types) > 2:
            continue  # GGUFReader flattens nested arrays; checked against the written values
        _assert_same_value(model.metadata[key], _reader_value(field), key)
    assert list(model.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        info = model.tensors[t.name]
        assert info.qtype == int(t.tensor_type)
        assert info.shape == tuple(reversed(t.shape.tolist()))
        assert info.range == ByteRange(str(path), int(t.data_offset), int(t.n_bytes))
        w = model.weight(t.name)
        assert w.data.numpy().tobytes() == t.data.tobytes(), t.name
