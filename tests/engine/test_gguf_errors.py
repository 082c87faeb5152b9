"""Malformed GGUF files: each fails with a GGUFError naming the file and saying what is wrong."""

import os
import struct
import time

import pytest
from gguf import GGUFValueType as VT

from localllm.engine.gguf import GGUFError, open_gguf
from localllm.kernels.quant import QuantType
from tests.engine.gguf_fixtures import (
    f32_tensor_info,
    raw_gguf,
    raw_kv,
    raw_string,
    raw_tensor_info,
)

ARCH = raw_kv("general.architecture", VT.STRING, raw_string("llama"))
U64_MAX = 2**64 - 1


def expect_error(tmp_path, content: bytes, *patterns: str, name="bad.gguf") -> str:
    """Write `content`, open it, and check the GGUFError names the file and matches `patterns`."""
    path = tmp_path / name
    path.write_bytes(content)
    t0 = time.perf_counter()
    with pytest.raises(GGUFError) as e:
        open_gguf(path)
    assert time.perf_counter() - t0 < 1.0, "a bad file must fail fast"
    msg = str(e.value)
    assert msg.startswith(f"{path}: "), msg
    for p in patterns:
        assert p in msg, f"{p!r} not in {msg!r}"
    return msg


def test_not_a_file(tmp_path):
    assert issubclass(GGUFError, ValueError)
    with pytest.raises(GGUFError, match=r"nope.gguf: cannot open GGUF file \(No such file"):
        open_gguf(tmp_path / "nope.gguf")
    with pytest.raises(GGUFError, match="not a regular file"):
        open_gguf(tmp_path)
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)  # opening a FIFO for reading would block forever
    with pytest.raises(GGUFError, match=r"fifo\.gguf: not a regular file"):
        open_gguf(fifo)


def test_empty_and_bad_magic(tmp_path):
    expect_error(tmp_path, b"", "empty file (0 bytes)")
    expect_error(tmp_path, b"GG", "truncated at offset 0 while reading the magic")
    expect_error(tmp_path, b"PK\x03\x04" + b"\0" * 40, "not a GGUF file", "b'PK\\x03\\x04'")
    expect_error(tmp_path, b"lmgg" + b"\0" * 40, "legacy GGML/GGJT")


def test_versions(tmp_path):
    expect_error(tmp_path, raw_gguf(version=1), "unsupported GGUF version 1", "re-converted")
    expect_error(tmp_path, raw_gguf(version=4), "unsupported GGUF version 4", "2, 3")
    big_endian = b"GGUF" + struct.pack(">IQQ", 3, 0, 0)
    expect_error(tmp_path, big_endian, "big-endian GGUF (version 3) is not supported")
    expect_error(tmp_path, b"GGUF\x03\x00", "truncated at offset 4 while reading the version")
    expect_error(tmp_path, b"GGUF\x03\0\0\0\0\0", "while reading the tensor count")


def test_absurd_counts_fail_at_once(tmp_path):
    expect_error(tmp_path, raw_gguf([ARCH], n_kv=U64_MAX), "claims 18446744073709551615")
    expect_error(tmp_path, raw_gguf([ARCH], n_tensors=2**40), "tensor count claims")
    huge_array = raw_kv("a", VT.ARRAY, struct.pack("<IQ", VT.UINT64, 2**61))
    expect_error(tmp_path, raw_gguf([huge_array]), "array of UINT64 of key 'a'", "claims")
    huge_str = raw_kv("s", VT.STRING, struct.pack("<Q", U64_MAX) + b"abc")
    expect_error(tmp_path, raw_gguf([huge_str]), "string value of key 's'", "needed 1844674")
    huge_key = struct.pack("<Q", 2**62) + b"k" * 16
    expect_error(tmp_path, raw_gguf([huge_key]), "metadata key #0", "truncated")
    huge_strs = raw_kv(
        "t", VT.ARRAY, struct.pack("<IQ", VT.STRING, 2) + struct.pack("<Q", 2**50) + b"x" * 16
    )
    expect_error(tmp_path, raw_gguf([huge_strs]), "string 0 of the array of key 't'")


def test_unknown_and_bad_types(tmp_path):
    expect_error(tmp_path, raw_gguf([raw_kv("k", 13, b"\0" * 8)]), "unknown value type 13", "'k'")
    bad_elem = raw_kv("k", VT.ARRAY, struct.pack("<IQ", 99, 1) + b"\0" * 8)
    expect_error(tmp_path, raw_gguf([bad_elem]), "unknown value type 99 for array elements of 'k'")
    info = raw_tensor_info("blk.0.w", [32], 4, 0)  # 4 was Q4_2, removed from ggml
    expect_error(tmp_path, raw_gguf([ARCH], [info], b"\0" * 64), "'blk.0.w'", "ggml type id 4")
    deep = struct.pack("<IQ", VT.ARRAY, 1) * 20 + struct.pack("<IQ", VT.UINT8, 0)
    expect_error(tmp_path, raw_gguf([raw_kv("n", VT.ARRAY, deep)]), "nest deeper than 8")


def test_bad_utf8_in_identifiers(tmp_path):
    expect_error(tmp_path, raw_gguf([raw_kv(b"k\xff", VT.UINT8, b"\0")]), "key #0", "UTF-8")
    info = raw_tensor_info(b"w\xc3", [4], 0, 0)
    expect_error(tmp_path, raw_gguf([], [info], b"\0" * 32), "name of tensor info #0", "UTF-8")


def test_duplicates(tmp_path):
    kv = raw_kv("k", VT.UINT8, b"\1")
    expect_error(tmp_path, raw_gguf([ARCH, kv, kv]), "duplicate metadata key 'k'", "key #2")
    infos = [f32_tensor_info("w", 8, 0), f32_tensor_info("w", 8, 32)]
    expect_error(tmp_path, raw_gguf([], infos, b"\0" * 64), "duplicate tensor name 'w'")


@pytest.mark.parametrize(
    ("ne", "qtype", "hint"),
    [
        ([], QuantType.F32, "n_dims=0, expected 1..4"),
        ([1, 1, 1, 1, 1], QuantType.F32, "n_dims=5"),
        ([4, 0], QuantType.F32, "ne=[4, 0]"),
        ([2**63, 1], QuantType.F32, "expected each and their product in 1..2^63-1"),
        ([2**40, 2**40], QuantType.F16, "product"),
        ([33, 2], QuantType.Q4_0, "rows of 33 elements, not a multiple of the block size 32"),
        ([256 + 32], QuantType.Q4_K, "block size 256"),
    ],
)
def test_bad_dimensions(tmp_path, ne, qtype, hint):
    info = raw_tensor_info("blk.3.ffn_up.weight", ne, int(qtype), 0)
    expect_error(tmp_path, raw_gguf([ARCH], [info], b"\0" * 4096), "'blk.3.ffn_up.weight'", hint)


def test_layout_errors(tmp_path):
    unaligned = [f32_tensor_info("a", 8, 0), f32_tensor_info("b", 8, 48)]
    expect_error(tmp_path, raw_gguf([], unaligned, b"\0" * 128), "data offset 48, not a multiple")
    overlap = [f32_tensor_info("a", 16, 0), f32_tensor_info("b", 8, 32)]
    expect_error(
        tmp_path, raw_gguf([], overlap, b"\0" * 128), "'b' data starts", "inside tensor 'a'"
    )
    past = [f32_tensor_info("a", 8, 0), f32_tensor_info("b", 8, 32)]
    msg = expect_error(tmp_path, raw_gguf([], past, b"\0" * 40), "'b' data", "runs past the end")
    assert "truncated download?" in msg


@pytest.mark.parametrize(
    ("payload", "hint"),
    [
        (raw_kv("general.alignment", VT.UINT32, struct.pack("<I", 0)), "is 0"),
        (raw_kv("general.alignment", VT.UINT32, struct.pack("<I", 48)), "is 48"),
        (raw_kv("general.alignment", VT.STRING, raw_string("32")), "is '32'"),
        (raw_kv("general.alignment", VT.BOOL, b"\1"), "is True"),
    ],
)
def test_bad_alignment(tmp_path, payload, hint):
    expect_error(tmp_path, raw_gguf([payload]), "general.alignment", hint, "power-of-two")


def test_other_alignment_integer_types_are_accepted(tmp_path):
    kv = raw_kv("general.alignment", VT.UINT64, struct.pack("<Q", 64))
    path = tmp_path / "a.gguf"
    path.write_bytes(raw_gguf([kv], [f32_tensor_info("w", 4, 64)], b"\0" * 128, alignment=64))
    assert open_gguf(path).tensors["w"].range.offset % 64 == 0
