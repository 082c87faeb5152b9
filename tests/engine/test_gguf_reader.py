"""open_gguf on well-formed files written by gguf.GGUFWriter, checked against gguf.GGUFReader."""

import struct

import numpy as np
import pytest
import torch
from gguf import GGUFValueType as VT

from localllm.engine.gguf import TensorInfo, open_gguf
from localllm.kernels.quant import QuantType, block_geometry
from localllm.offload import QuantWeight
from tests.engine.gguf_fixtures import (
    GGUFValue,
    assert_matches_reader,
    random_blocks,
    raw_gguf,
    raw_kv,
    raw_string,
    write_gguf,
)

ALL_TYPES = {
    "t.u8": GGUFValue(200, VT.UINT8),
    "t.i8": GGUFValue(-100, VT.INT8),
    "t.u16": GGUFValue(60000, VT.UINT16),
    "t.i16": GGUFValue(-30000, VT.INT16),
    "t.u32": GGUFValue(4_000_000_000, VT.UINT32),
    "t.i32": GGUFValue(-2_000_000_000, VT.INT32),
    "t.u64": GGUFValue(2**64 - 1, VT.UINT64),
    "t.i64": GGUFValue(-(2**63), VT.INT64),
    "t.f32": GGUFValue(0.1, VT.FLOAT32),
    "t.f64": GGUFValue(0.1, VT.FLOAT64),
    "t.bool": True,
    "t.false": False,
    "t.str": "héllo wörld ✓ 日本語 🦙",
    "t.empty_str": GGUFValue("", VT.STRING),
    "t.strs": ["a", "", "ü", "<0x0A>", "▁the", "🦙🦙"],
    "t.arr_u8": np.array([0, 1, 255], np.uint8),
    "t.arr_i8": np.array([-128, 0, 127], np.int8),
    "t.arr_u16": np.array([1, 65535], np.uint16),
    "t.arr_i16": np.array([-32768, 5], np.int16),
    "t.arr_u32": np.array([1, 2**32 - 1], np.uint32),
    "t.arr_i32": np.array([-1, 7, 2**31 - 1], np.int32),
    "t.arr_u64": np.array([0, 2**64 - 1], np.uint64),
    "t.arr_i64": np.array([-(2**63), 3], np.int64),
    "t.arr_f32": np.array([0.5, -1e30, np.inf], np.float32),
    "t.arr_f64": np.array([1e300, -0.0], np.float64),
    "t.arr_bool": np.array([True, False, True]),
    "t.nested": [[1, 2, 3], [4], [5, 6]],
    "t.nested_str": [["a", "b"], ["ü"]],
    "t.nested2": [[[1.5], [2.5, 3.5]], [[4.5]]],
}


def _tensors():
    rng = np.random.default_rng(1)
    return {
        "f32": rng.standard_normal((3, 5)).astype(np.float32),
        "f16": rng.standard_normal((2, 3, 4)).astype(np.float16),
        "vec": rng.standard_normal(7).astype(np.float32),
        "i32": np.arange(6, dtype=np.int32).reshape(2, 3),
        "q4_0": random_blocks(QuantType.Q4_0, (4, 64), 2),
        "q4_k": random_blocks(QuantType.Q4_K, (3, 512), 3),
        "q8_0_4d": random_blocks(QuantType.Q8_0, (2, 1, 3, 32), 4),
        "iq2_xs": random_blocks(QuantType.IQ2_XS, (1, 256), 5),
        "mxfp4": random_blocks(QuantType.MXFP4, (2, 64), 6),
    }


@pytest.mark.parametrize("alignment", [None, 1, 8, 64, 4096])
def test_matches_gguf_reader(tmp_path, alignment):
    path = write_gguf(tmp_path / "m.gguf", ALL_TYPES, _tensors(), alignment=alignment)
    with open_gguf(path) as model:
        assert_matches_reader(model, path)
        assert model.version == 3
        assert model.architecture == "llama" and model.get("general.architecture") == "llama"
        assert model.get("no.such.key", 42) == 42
        assert model.nbytes == sum(t.range.nbytes for t in model.tensors.values())
        if alignment is not None:
            assert model.metadata["general.alignment"] == alignment
            assert all(t.range.offset % alignment == 0 for t in model.tensors.values())


def test_value_representation(tmp_path):
    meta = open_gguf(write_gguf(tmp_path / "m.gguf", ALL_TYPES)).metadata
    for key, written in ALL_TYPES.items():
        got = meta[key]
        value = written.value if isinstance(written, GGUFValue) else written
        if isinstance(value, np.ndarray):
            assert got.dtype == value.dtype and got.shape == value.shape, key
            np.testing.assert_array_equal(got, value)
            assert got.flags.owndata or (got.base is not None and got.base.flags.owndata)
        elif key == "t.f32":
            assert got == float(np.float32(0.1))
        elif not key.startswith("t.nested"):
            assert type(got) is type(value) and got == value, key
    assert meta["t.strs"] == ALL_TYPES["t.strs"]
    nested = meta["t.nested"]
    assert isinstance(nested, list) and [a.tolist() for a in nested] == [[1, 2, 3], [4], [5, 6]]
    assert all(a.dtype == np.int32 for a in nested)
    assert meta["t.nested_str"] == [["a", "b"], ["ü"]]
    assert [[a.tolist() for a in inner] for inner in meta["t.nested2"]] == [
        [[1.5], [2.5, 3.5]],
        [[4.5]],
    ]


def test_tensor_infos_and_weights(tmp_path):
    tensors = _tensors()
    model = open_gguf(write_gguf(tmp_path / "m.gguf", {}, tensors))
    for name, t in tensors.items():
        info = model.tensors[name]
        assert isinstance(info, TensorInfo)
        w = model.weight(name)
        assert isinstance(w, QuantWeight) and w.source == info.range
        if isinstance(t, tuple):
            raw, qtype, shape = t
            assert (info.qtype, info.shape) == (qtype, shape)
            assert w.data.numpy().tobytes() == raw.tobytes()
            block, nbytes = block_geometry(qtype)
            assert tuple(w.data.shape) == (*shape[:-1], shape[-1] // block * nbytes)
        else:
            assert info.shape == t.shape
            assert w.data.numpy().tobytes() == t.tobytes()
            assert w.data.view(torch.from_numpy(t).dtype).shape == (*t.shape[:-1], t.shape[-1])
    with pytest.raises(KeyError, match="no tensor named 'nope'"):
        model.weight("nope")


def test_weight_is_zero_copy_view_of_the_mapping(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", {}, _tensors(), alignment=64)
    on_disk = path.read_bytes()
    model = open_gguf(path)
    info = model.tensors["q4_k"]
    mapped = model.mapped_file(info.range.path)
    base = np.frombuffer(mapped.buffer(), np.uint8).ctypes.data
    w = model.weight("q4_k")
    # The tensor's storage is the mapping itself, at the tensor's offset: nothing was copied.
    assert w.data.data_ptr() == base + info.range.offset
    assert w.data.untyped_storage().data_ptr() == base + info.range.offset
    # Writing through the view shows through the mapping (aliasing), never reaches the file.
    old = int(w.data.view(-1)[0])
    w.data.view(-1)[0] = (old + 1) % 256
    assert mapped.buffer()[info.range.offset] == (old + 1) % 256
    assert model.weight("q4_k").data.view(-1)[0] == (old + 1) % 256
    assert path.read_bytes() == on_disk


def test_close_and_context_manager(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", {}, {"w": np.ones(4, np.float32)})
    with open_gguf(path) as model:
        w = model.weight("w")
    with pytest.raises(ValueError, match="closed"):
        model.weight("w")
    # A view handed out before close stays valid: it keeps its pages alive.
    assert w.data.view(torch.float32).tolist() == [1.0] * 4
    assert "GGUFModel(" in repr(model) and model.tensors["w"].shape == (4,)


def test_missing_architecture_is_fine_here(tmp_path):
    model = open_gguf(write_gguf(tmp_path / "m.gguf", {"a": 1}, arch=None))
    assert model.architecture is None and model.metadata == {"a": 1}


def test_version_2_file(tmp_path):
    kv = raw_kv("general.architecture", VT.STRING, raw_string("llama"))
    path = tmp_path / "v2.gguf"
    path.write_bytes(raw_gguf([kv], version=2))
    model = open_gguf(path)
    assert model.version == 2 and model.architecture == "llama" and model.tensors == {}


def test_invalid_utf8_values_are_kept_losslessly(tmp_path):
    # Byte-level tokens that are not valid UTF-8 alone; llama.cpp keeps the raw bytes.
    tokens = [b"ok", b"\xe2\x96", b"\xff", "ü".encode()]
    arr = struct.pack("<IQ", VT.STRING, len(tokens)) + b"".join(raw_string(t) for t in tokens)
    kvs = [
        raw_kv("tokenizer.ggml.tokens", VT.ARRAY, arr),
        raw_kv("bad.scalar", VT.STRING, raw_string(b"a\x80b")),
    ]
    path = tmp_path / "bytes.gguf"
    path.write_bytes(raw_gguf(kvs))
    meta = open_gguf(path).metadata
    got = meta["tokenizer.ggml.tokens"]
    assert got[0] == "ok" and got[3] == "ü"
    assert [s.encode("utf-8", "surrogateescape") for s in got] == tokens
    assert meta["bad.scalar"].encode("utf-8", "surrogateescape") == b"a\x80b"


def test_empty_arrays_and_bool_bytes(tmp_path):
    kvs = [
        raw_kv("e.num", VT.ARRAY, struct.pack("<IQ", VT.UINT16, 0)),
        raw_kv("e.str", VT.ARRAY, struct.pack("<IQ", VT.STRING, 0)),
        raw_kv("e.arr", VT.ARRAY, struct.pack("<IQ", VT.ARRAY, 0)),
        raw_kv("b.two", VT.BOOL, b"\x02"),
        raw_kv("b.arr", VT.ARRAY, struct.pack("<IQ", VT.BOOL, 3) + b"\x00\x01\x07"),
    ]
    path = tmp_path / "e.gguf"
    path.write_bytes(raw_gguf(kvs))
    meta = open_gguf(path).metadata
    assert meta["e.num"].dtype == np.uint16 and meta["e.num"].shape == (0,)
    assert meta["e.str"] == [] and meta["e.arr"] == []
    assert meta["b.two"] is True
    assert meta["b.arr"].dtype == np.bool_ and meta["b.arr"].tolist() == [False, True, True]


def test_value_type_ids_match_gguf():
    from localllm.engine.gguf.values import ValueType

    assert {t.name: t.value for t in ValueType} == {t.name: t.value for t in VT}
