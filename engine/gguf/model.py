"""`open_gguf`: one GGUF model (a single file or a `-0000i-of-0000N.gguf` split set) over mmaps.

Each shard is mapped once (`offload.MappedFile`), parsed straight from the mapping, and kept
mapped so `weight(name)` can hand out zero-copy views of the raw ggml blocks.
"""

import os
import re
import stat
from dataclasses import dataclass
from typing import Any

from localllm.engine.gguf.errors import GGUFError
from localllm.engine.gguf.parse import ParsedFile, parse_gguf
from localllm.kernels.quant import QuantType, block_geometry
from localllm.offload import ByteRange, MappedFile, QuantWeight

SPLIT_NO = "split.no"
SPLIT_COUNT = "split.count"
SPLIT_TENSORS_COUNT = "split.tensors.count"
# llama.cpp's split naming (llama_split_path): PREFIX-00001-of-00003.gguf, numbered from 1.
_SHARD_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: ggml type, torch-order shape (GGUF ne reversed), byte range."""

    name: str
    qtype: QuantType
    shape: tuple[int, ...]
    range: ByteRange


class GGUFModel:
    """An opened GGUF model (built by `open_gguf`).

    `path` is the first shard, `shards` all of them in order; `metadata` comes from the first
    shard (values as described in values.py); `tensors` spans every shard, in file order.
    """

    def __init__(self, shards: list[tuple[MappedFile, ParsedFile]]):
        first = shards[0][1]
        self.path: str = first.path
        self.shards: tuple[str, ...] = tuple(p.path for _, p in shards)
        self.version: int = first.version
        self.metadata: dict[str, Any] = first.metadata
        self.tensors: dict[str, TensorInfo] = {}
        for _, parsed in shards:
            for t in parsed.tensors:
                if t.name in self.tensors:
                    raise GGUFError(
                        f"{parsed.path}: tensor {t.name!r} is also in "
                        f"{self.tensors[t.name].range.path} (duplicate across shards)"
                    )
                rng = ByteRange(parsed.path, t.offset, t.nbytes)
                self.tensors[t.name] = TensorInfo(t.name, t.qtype, t.shape, rng)
        self._files: dict[str, MappedFile] | None = {p.path: mf for mf, p in shards}
        # token rows are gathered a few at a time: 4 KiB pages keep only the rows used resident
        # (a tied table is also the output head, read whole every token: it keeps 2 MiB pages)
        embd = self.tensors.get("token_embd.weight")
        if embd is not None and "output.weight" in self.tensors:
            self._files[embd.range.path].advise(embd.range, huge=False)

    @property
    def architecture(self) -> str | None:
        """`general.architecture`, or None when absent (the model loader reports that)."""
        return self.metadata.get("general.architecture")

    @property
    def nbytes(self) -> int:
        """Total bytes of tensor data across all shards."""
        return sum(t.range.nbytes for t in self.tensors.values())

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def mapped_file(self, path: str) -> MappedFile:
        """The mapping of one shard, for code that reads `TensorInfo.range`s itself."""
        if self._files is None:
            raise ValueError(f"{self.path}: GGUF model is closed")
        return self._files[path]

    def weight(self, name: str) -> QuantWeight:
        """The raw ggml blocks of tensor `name`: a zero-copy uint8 view shaped [..., row_bytes]."""
        info = self.tensors.get(name)
        if info is None:
            raise KeyError(f"{self.path}: no tensor named {name!r} ({len(self.tensors)} tensors)")
        block, block_bytes = block_geometry(info.qtype)
        row_bytes = info.shape[-1] // block * block_bytes
        data = self.mapped_file(info.range.path).view(info.range)
        data = data.view(*info.shape[:-1], row_bytes)
        return QuantWeight(data, info.qtype, info.shape, source=info.range)

    def close(self) -> None:
        """Drop the mappings. Views already handed out keep their pages alive until freed."""
        self._files = None

    def __enter__(self) -> "GGUFModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"GGUFModel({self.path!r}, arch={self.architecture!r}, shards={len(self.shards)}, "
            f"tensors={len(self.tensors)}, nbytes={self.nbytes})"
        )


def _map(path: str) -> MappedFile:
    try:
        st = os.stat(path)
    except OSError as e:
        raise GGUFError(f"{path}: cannot open GGUF file ({e.strerror})") from e
    # Refuse directories, FIFOs and devices before opening: a FIFO would block forever.
    if not stat.S_ISREG(st.st_mode):
        raise GGUFError(f"{path}: not a regular file, expected a .gguf model file")
    try:
        return MappedFile(path)
    except (OSError, ValueError) as e:
        raise GGUFError(f"{path}: cannot map GGUF file ({e})") from e


def _open_one(path: str) -> tuple[MappedFile, ParsedFile]:
    mf = _map(path)
    return mf, parse_gguf(path, mf.buffer())


def _split_int(parsed: ParsedFile, key: str) -> int | None:
    value = parsed.metadata.get(key)
    if value is not None and type(value) is not int:
        raise GGUFError(f"{parsed.path}: metadata {key!r} is {value!r}, expected an integer")
    return value


def _open_split(prefix: str, count: int, first: tuple[MappedFile, ParsedFile]) -> GGUFModel:
    names = [f"{prefix}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    missing = [n for n in names if not os.path.exists(n)]
    if missing:
        raise GGUFError(f"{names[0]}: split model of {count} files is missing {', '.join(missing)}")
    shards = [first] + [_open_one(n) for n in names[1:]]
    for i, (_, parsed) in enumerate(shards):
        no = _split_int(parsed, SPLIT_NO)
        if no is not None and no != i:
            raise GGUFError(f"{parsed.path}: {SPLIT_NO} is {no}, expected {i} from the file name")
        n = _split_int(parsed, SPLIT_COUNT)
        if n is not None and n != count:
            raise GGUFError(f"{parsed.path}: {SPLIT_COUNT} is {n}, the file names say {count}")
    model = GGUFModel(shards)
    expected = _split_int(first[1], SPLIT_TENSORS_COUNT)
    if expected is not None and expected != len(model.tensors):
        raise GGUFError(
            f"{names[0]}: {SPLIT_TENSORS_COUNT} is {expected} but the {count} shards hold "
            f"{len(model.tensors)} tensors"
        )
    return model


def open_gguf(path: str | os.PathLike) -> GGUFModel:
    """Open a GGUF model. For a split set, pass any shard; metadata comes from the first."""
    path = os.fspath(path)
    m = _SHARD_NAME.match(path)
    if m is None:
        first = _open_one(path)
        count = _split_int(first[1], SPLIT_COUNT)
        if count is not None and count > 1:
            raise GGUFError(
                f"{path}: metadata says this is one of a {count}-file split, but the name does "
                "not follow PREFIX-00001-of-0000N.gguf, so the other shards cannot be found"
            )
        return GGUFModel([first])
    count, no = int(m["count"]), int(m["no"])
    if not 1 <= no <= count:
        raise GGUFError(f"{path}: shard number {no} is outside 1..{count}")
    first_path = f"{m['prefix']}-00001-of-{count:05d}.gguf"
    if not os.path.exists(first_path):
        raise GGUFError(f"{path}: the first shard of this split, {first_path}, is missing")
    first = _open_one(first_path)
    meta_count = _split_int(first[1], SPLIT_COUNT)
    if meta_count is None and count > 1:
        raise GGUFError(
            f"{first_path}: the name says shard 1 of {count} but the file has no "
            f"{SPLIT_COUNT} metadata"
        )
    if meta_count is None:
        return GGUFModel([first])
    return _open_split(m["prefix"], count, first)
