"""`open_hf`: a Hugging Face `save_pretrained` folder read as the engine reads a GGUF.

`HFCheckpoint` offers what the loader uses of a `GGUFModel` (`path`, `metadata`, `tensors`,
`weight(name)`, `close`): GGUF metadata written from config.json by the family's `*_hf.py`,
tensors under their GGUF names (`plan.TensorPlan`). Weights stay in the shards' mappings as
stored (F32/F16/BF16: zero-copy views) unless the family changes them (a copy of those only) or
`quantize` asks for ggml blocks, made per tensor as the loader takes it. 1-D tensors, norms and
MoE routers are float32, as llama.cpp's converter writes them.
"""

import json
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from localllm.engine.hf.config import HFConfig, HFConfigError, check_not_prequantized
from localllm.engine.hf.families import UnsupportedHFArchitectureError, family_module
from localllm.engine.hf.plan import Recipe, TensorPlan
from localllm.engine.hf.quantize import (
    QUANTIZE_TYPES,
    quantize,
    release_scratch,
    store_type,
)
from localllm.engine.hf.safetensors import DTYPES, SafetensorsError, SafetensorsFile, StTensor
from localllm.engine.hf.spill import spill_dir, spill_key, write_spill
from localllm.kernels.quant import QuantType
from localllm.offload import ByteRange, MappedFile, QuantWeight

INDEX = "model.safetensors.index.json"
_EXPERT = re.compile(r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight")  # what the disk tier streams
SINGLE = "model.safetensors"
# `--quantize` also takes the float types: the weights converted to one of them at load
STORE_TYPES = {**QUANTIZE_TYPES, "f32": QuantType.F32, "f16": QuantType.F16, "bf16": QuantType.BF16}
_FLOAT = {"F32": QuantType.F32, "F16": QuantType.F16, "BF16": QuantType.BF16}
_TORCH = {
    QuantType.F32: torch.float32,
    QuantType.F16: torch.float16,
    QuantType.BF16: torch.bfloat16,
}


class HFError(ValueError):
    """A model folder that cannot be run (the message starts with the folder)."""


@dataclass(frozen=True)
class HFTensorInfo:
    """A tensor as the engine will hold it: ggml type, torch-order shape, and its bytes in a
    shard when it is used as stored (else None)."""

    name: str
    qtype: QuantType
    shape: tuple[int, ...]
    range: ByteRange | None

    @property
    def nbytes(self) -> int:
        return _nbytes(self.qtype, self.shape)


def is_hf_folder(path: str | os.PathLike) -> bool:
    """A folder with config.json and safetensors weights (or an index of them)."""
    p = Path(path)
    return (
        p.is_dir()
        and (p / "config.json").is_file()
        and ((p / INDEX).is_file() or any(p.glob("*.safetensors")))
    )


def open_hf(path: str | os.PathLike, quantize: str | None = None) -> "HFCheckpoint":
    """Open a folder; every error is an `HFError` naming it."""
    folder = Path(path)
    try:
        return HFCheckpoint(folder, quantize)
    except (HFConfigError, UnsupportedHFArchitectureError, SafetensorsError, ValueError) as e:
        if isinstance(e, HFError):
            raise
        text = str(e)
        raise HFError(text if text.startswith(str(folder)) else f"{folder}: {text}") from None


class HFCheckpoint:
    """A model folder opened for loading (see the module docstring)."""

    views = True  # tensors as stored are views of the mapping (the loader's zero-copy path)

    def __init__(self, folder: Path, quantize: str | None = None):
        self.path = str(folder)
        self._spill: MappedFile | None = None  # the disk tier's made tensors (place_on_disk)
        if quantize is not None and quantize not in STORE_TYPES:
            raise HFError(
                f"{folder}: --quantize {quantize!r} is not a type we make "
                f"(one of: {', '.join(STORE_TYPES)})"
            )
        self.quantize = STORE_TYPES[quantize] if quantize else None
        raw = _json(folder / "config.json")
        check_not_prequantized(raw)
        cfg = HFConfig(raw)
        self.config = cfg
        family = family_module(cfg.architecture)
        # floats as a GGUF stores them (float32), so both give the same `ModelArgs`
        self.metadata: dict[str, Any] = {
            k: float(np.float32(v)) if type(v) is float else v
            for k, v in family.metadata(cfg).items()
        }
        self.files = _shards(folder)
        self.shards = tuple(f.path for f in self.files.values())
        tensors = {}
        for f in self.files.values():
            for name, t in f.tensors.items():
                if name in tensors:
                    raise HFError(f"{f.path}: tensor {name!r} is also in another shard")
                tensors[name] = t
        self._where = {name: f for f in self.files.values() for name in f.tensors}
        n_layers = self.metadata.get(f"{self.architecture}.block_count")
        if type(n_layers) is not int:
            raise HFError(f"{folder}: config.json 'num_hidden_layers' is {n_layers!r}")
        plan = TensorPlan(
            self.architecture, n_layers, tensors, getattr(family, "checkpoint_name", None)
        )
        family.adapt(plan, cfg, tokenizer_size(folder))
        if cfg.tied:
            plan.drop("output.weight")  # transformers computes with the embedding either way
        elif "output.weight" not in plan.entries:
            raise HFError(
                f"{folder}: config.json says tie_word_embeddings is false but there is no "
                "lm_head.weight"
            )
        self.plan = plan
        self.tensors: dict[str, HFTensorInfo] = {
            name: HFTensorInfo(
                name,
                self._store_type(name, r),
                r.shape,
                _range(tensors[r.sources[0]], r) if r.as_stored else None,
            )
            for name, r in plan.entries.items()
        }

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def _store_type(self, name: str, r: Recipe) -> QuantType:
        stored = _FLOAT.get(r.dtype)
        floaty = len(r.shape) < 2 or name.endswith("_norm.weight") or ".ffn_gate_inp." in name
        if floaty or not name.endswith(".weight") or r.values is not None:
            return QuantType.F32
        if self.quantize in _TORCH:
            return self.quantize
        made = store_type(self.quantize, r.shape[-1]) if self.quantize is not None else None
        if made is not None:
            return made
        if stored is None:
            raise HFError(f"{self.path}: tensor {self.plan.origin.get(name, name)!r} is stored as "
                          f"{r.dtype}, not a float type we run")  # fmt: skip
        return stored

    def place_on_disk(self, names: Iterable[str]) -> None:
        """Tensors a residency plan puts on the disk tier must come from a file (the expert
        streaming reads them by byte range): those used as stored already do. Where one is
        made at load (stacked experts, `--quantize` blocks), every made expert tensor is
        written once to the folder's spill file (`spill`; one per `--quantize`, whatever the
        plan: the next load maps it again) and is a view of its mapping from now on."""
        if not any(n in self.tensors and self.tensors[n].range is None for n in names):
            return
        infos = [t for n, t in self.tensors.items() if t.range is None and _EXPERT.fullmatch(n)]
        key = spill_key(Path(self.path), self.shards, self.quantize and self.quantize.name,
                        [(t.name, t.qtype.name, t.shape) for t in infos])  # fmt: skip
        path = spill_dir(Path(self.path)) / f"spill-{key}.bin"

        def make(name: str) -> memoryview:
            return memoryview(self.weight(name).data.contiguous().numpy()).cast("B")

        try:
            ranges = write_spill(path, {t.name: t.nbytes for t in infos}, make)
        except OSError as e:
            raise HFError(f"{self.path}: cannot write the disk tier's spill file: {e}") from None
        self._spill = MappedFile(path)
        for t in infos:
            self.tensors[t.name] = replace(t, range=ranges[t.name])

    def weight(self, name: str) -> QuantWeight:
        """Tensor `name` in its ggml type: a view of the shard when used as stored (or of the
        spill file, `place_on_disk`)."""
        info = self.tensors.get(name)
        if info is None:
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        spill = self._spill
        if spill is not None and info.range is not None and info.range.path == spill.path:
            rows = spill.view(info.range).view(*info.shape[:-1], -1)
            return QuantWeight(rows, info.qtype, info.shape, source=info.range)
        r = self.plan.entries[name]
        if info.range is not None and _FLOAT.get(r.dtype) == info.qtype:
            data = self._where[r.sources[0]].raw(r.sources[0])[: r.rows]
            return QuantWeight(data, info.qtype, info.shape, source=info.range)
        if r.values is not None:
            x = r.values
        else:
            xs = [self._where[s].view(s)[: r.rows] for s in r.sources]
            if r.make is not None:
                x = r.make(*(t.float() for t in xs))
            else:
                x = xs[0]
        if tuple(x.shape) != info.shape:
            raise HFError(f"{self.path}: {name} came out {tuple(x.shape)}, not {info.shape}")
        dtype = _TORCH.get(info.qtype)
        if dtype is not None:
            data = x.to(dtype).contiguous().view(torch.uint8)
            data = data.reshape(*info.shape[:-1], -1) if info.shape else data
        else:
            data = quantize(x, info.qtype)
        return QuantWeight(data, info.qtype, info.shape)

    def close(self) -> None:
        """Drop the shard mappings (each stays mapped while a weight views it)."""
        self.files = {}
        self._where = {}
        if self.quantize is not None:
            release_scratch()

    def __enter__(self) -> "HFCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"HFCheckpoint({self.path!r}, arch={self.architecture!r}, shards={len(self.shards)})"


def tokenizer_size(folder: Path) -> int | None:
    """Ids the folder's tokenizer.json defines (its largest + 1), or None without one."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    data = _json(path)
    model = data.get("model") if isinstance(data, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    ids = list(vocab.values()) if isinstance(vocab, dict) else []
    if isinstance(vocab, list):  # Unigram: [piece, score] pairs
        ids = [len(vocab) - 1]
    ids += [t.get("id", -1) for t in data.get("added_tokens") or () if isinstance(t, dict)]
    ids = [i for i in ids if type(i) is int]
    return max(ids) + 1 if ids else None


def _range(t: StTensor, r: Recipe) -> ByteRange:
    """The bytes of what is used of a stored tensor (its first rows only, with `rows`)."""
    if r.rows is None:
        return t.range
    return ByteRange(t.range.path, t.range.offset, t.range.nbytes // t.shape[0] * r.rows)


def _nbytes(qtype: QuantType, shape: tuple[int, ...]) -> int:
    from localllm.kernels.quant import block_geometry

    block, nbytes = block_geometry(qtype)
    return math.prod(shape) // block * nbytes


def _json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise HFError(f"{path.parent}: no {path.name}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFError(f"{path}: not valid JSON ({e})") from None


def _shards(folder: Path) -> dict[str, SafetensorsFile]:
    """The weight files, in index order, each checked to hold what the index says."""
    index = folder / INDEX
    if index.is_file():
        wmap = _json(index).get("weight_map")
        if not isinstance(wmap, dict) or not wmap:
            raise HFError(f"{index}: no weight_map")
        names = list(dict.fromkeys(wmap.values()))
        bad = [n for n in names if not isinstance(n, str) or "/" in n or n.startswith(".")]
        if bad:
            raise HFError(f"{index}: shard name {bad[0]!r} is not a file in the folder")
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise HFError(
                f"{folder}: missing {len(missing)} of {len(names)} weight shards named by "
                f"{INDEX}: {', '.join(missing[:4])}"
            )
        files = {n: SafetensorsFile(folder / n) for n in names}
        for tensor, shard in wmap.items():
            if tensor not in files[shard].tensors:
                raise HFError(f"{folder / shard}: lacks tensor {tensor!r} that {INDEX} puts there")
        return files
    if (folder / SINGLE).is_file():
        return {SINGLE: SafetensorsFile(folder / SINGLE)}
    found = sorted(folder.glob("*.safetensors"))
    if len(found) == 1:
        return {found[0].name: SafetensorsFile(found[0])}
    if found:
        raise HFError(f"{folder}: {len(found)} .safetensors files and no {INDEX} to join them")
    if any(folder.glob("*.bin")) or any(folder.glob("*.pth")):
        raise HFError(f"{folder}: only PyTorch pickle weights (.bin/.pth); localllm reads "
                      "safetensors (convert with transformers' save_pretrained)")  # fmt: skip
    raise HFError(f"{folder}: no model.safetensors or {INDEX}")


__all__ = ["DTYPES", "HFCheckpoint", "HFError", "HFTensorInfo", "is_hf_folder", "open_hf"]
