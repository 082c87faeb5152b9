"""Split models (PREFIX-0000i-of-0000N.gguf), as gguf.GGUFWriter and llama.cpp's gguf-split make."""

import shutil
import struct

import numpy as np
import pytest
from gguf import GGUFValueType as VT

from localllm.engine.gguf import GGUFError, open_gguf
from tests.engine.gguf_fixtures import f32_tensor_info, raw_gguf, raw_kv, write_gguf


def _tensors(n=7):
    rng = np.random.default_rng(0)
    return {f"blk.{i}.w": rng.standard_normal((i + 1, 8)).astype(np.float32) for i in range(n)}


@pytest.fixture
def split3(tmp_path):
    tensors = _tensors()
    meta = {"llama.block_count": 7, "tokenizer.ggml.tokens": ["a", "b", "ü"]}
    first = write_gguf(tmp_path / "m.gguf", meta, tensors, split_max_tensors=3)
    shards = [tmp_path / f"m-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    assert first == shards[0] and all(s.exists() for s in shards)
    return shards, tensors


@pytest.mark.parametrize("which", [0, 1, 2])
def test_open_via_any_shard(split3, which):
    shards, tensors = split3
    with open_gguf(shards[which]) as model:
        assert model.path == str(shards[0])
        assert model.shards == tuple(map(str, shards))
        assert model.architecture == "llama" and model.metadata["llama.block_count"] == 7
        assert model.metadata["tokenizer.ggml.tokens"] == ["a", "b", "ü"]
        assert model.metadata["split.count"] == 3 and model.metadata["split.no"] == 0
        assert list(model.tensors) == list(tensors)
        # 3 + 3 + 1 tensors, each from the shard that holds it.
        paths = [model.tensors[n].range.path for n in tensors]
        assert paths == [str(shards[i // 3]) for i in range(7)]
        for name, t in tensors.items():
            assert model.weight(name).data.numpy().tobytes() == t.tobytes()
        assert model.nbytes == sum(t.nbytes for t in tensors.values())


def test_missing_shard_is_named(split3):
    shards, _ = split3
    shards[1].unlink()
    for given in (shards[0], shards[2]):
        with pytest.raises(GGUFError, match=r"missing .*m-00002-of-00003\.gguf"):
            open_gguf(given)


def test_missing_first_shard(split3):
    shards, _ = split3
    shards[0].unlink()
    with pytest.raises(GGUFError, match=r"first shard .*m-00001-of-00003\.gguf.* is missing"):
        open_gguf(shards[1])


def test_renamed_split_file_is_refused(split3, tmp_path):
    shards, _ = split3
    lone = tmp_path / "renamed.gguf"
    shutil.copy(shards[0], lone)
    with pytest.raises(GGUFError, match=r"renamed\.gguf: .*3-file split"):
        open_gguf(lone)


def test_name_and_metadata_disagree(split3, tmp_path):
    shards, _ = split3
    # Only two of the three shards, renamed as a 2-file split: split.count says 3.
    for i, s in enumerate(shards[:2]):
        shutil.copy(s, tmp_path / f"x-{i + 1:05d}-of-00002.gguf")
    with pytest.raises(GGUFError, match=r"x-00001-of-00002\.gguf: split\.count is 3"):
        open_gguf(tmp_path / "x-00001-of-00002.gguf")


def _shard(no, count, total, tensors, extra_kvs=()):
    """One shard the way gguf-split writes it: split.* KVs, then its own tensors."""
    kvs = [
        raw_kv("split.no", VT.UINT16, struct.pack("<H", no)),
        raw_kv("split.count", VT.UINT16, struct.pack("<H", count)),
        raw_kv("split.tensors.count", VT.INT32, struct.pack("<i", total)),
        *extra_kvs,
    ]
    infos = [f32_tensor_info(name, 8, 32 * i) for i, name in enumerate(tensors)]
    return raw_gguf(kvs, infos, b"\0" * 32 * len(tensors))


def test_tensor_count_mismatch(tmp_path):
    (tmp_path / "s-00001-of-00002.gguf").write_bytes(_shard(0, 2, 5, ["a", "b"]))
    (tmp_path / "s-00002-of-00002.gguf").write_bytes(_shard(1, 2, 5, ["c"]))
    with pytest.raises(GGUFError, match=r"split.tensors.count is 5 but the 2 shards hold 3"):
        open_gguf(tmp_path / "s-00002-of-00002.gguf")


def test_duplicate_tensor_across_shards(tmp_path):
    (tmp_path / "s-00001-of-00002.gguf").write_bytes(_shard(0, 2, 3, ["a", "b"]))
    (tmp_path / "s-00002-of-00002.gguf").write_bytes(_shard(1, 2, 3, ["b"]))
    with pytest.raises(GGUFError, match=r"s-00002-of-00002.gguf: tensor 'b' is also in .*00001"):
        open_gguf(tmp_path / "s-00001-of-00002.gguf")


def test_shard_number_mismatch(tmp_path):
    (tmp_path / "s-00001-of-00002.gguf").write_bytes(_shard(0, 2, 2, ["a"]))
    (tmp_path / "s-00002-of-00002.gguf").write_bytes(_shard(0, 2, 2, ["b"]))
    with pytest.raises(GGUFError, match=r"s-00002-of-00002.gguf: split.no is 0, expected 1"):
        open_gguf(tmp_path / "s-00001-of-00002.gguf")


def test_split_name_without_split_metadata(tmp_path):
    write_gguf(tmp_path / "plain.gguf", {}, {"w": np.ones(4, np.float32)})
    (tmp_path / "plain.gguf").rename(tmp_path / "p-00001-of-00002.gguf")
    (tmp_path / "p-00002-of-00002.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match=r"p-00001-of-00002\.gguf: .*no split\.count"):
        open_gguf(tmp_path / "p-00002-of-00002.gguf")
    # A one-file "split" is just a file.
    (tmp_path / "p-00001-of-00002.gguf").rename(tmp_path / "q-00001-of-00001.gguf")
    assert list(open_gguf(tmp_path / "q-00001-of-00001.gguf").tensors) == ["w"]
