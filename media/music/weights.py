"""The tensors of a Hugging Face safetensors folder (`model.safetensors`, or the shards that
`model.safetensors.index.json` names), memory-mapped by the engine's reader
(`engine.hf.safetensors`: zero-copy views, hostile headers refused in one line).

A tensor is read when a module asks for it by name, cast to the compute dtype and moved to the
device there and then, so a load never holds a second full copy of the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from localllm.engine.hf.safetensors import DTYPES, SafetensorsError, SafetensorsFile
from localllm.media.music.config import MusicModelError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class Weights:
    """Named tensors over the folder's safetensors files, read on demand."""

    def __init__(self, folder: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32):  # fmt: skip
        self.folder = Path(folder)
        self.device, self.dtype = torch.device(device), dtype
        self._where: dict[str, Path] = {}
        self._open: dict[Path, SafetensorsFile] = {}
        for path in self._files():
            try:
                handle = SafetensorsFile(path)
            except SafetensorsError as e:
                raise MusicModelError(f"not a readable safetensors file: {e}") from None
            self._open[path] = handle
            for name in handle.tensors:
                self._where[name] = path

    def _files(self) -> list[Path]:
        index = self.folder / INDEX
        if index.is_file():
            try:
                wmap = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                files = list(dict.fromkeys(str(v) for v in wmap.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise MusicModelError(f"{index}: not a safetensors index ({e})") from None
            paths = [self.folder / name for name in files]
            missing = [p.name for p in paths if not p.is_file()]
            if missing:
                raise MusicModelError(f"{index}: names missing shards: {', '.join(missing)}")
            return paths
        if (self.folder / SINGLE).is_file():
            return [self.folder / SINGLE]
        raise MusicModelError(f"{self.folder}: no {SINGLE} or {INDEX}")

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return list(self._where)

    def raw(self, name: str) -> torch.Tensor:
        """The tensor as stored (CPU, its own dtype; a view of the mapping)."""
        path = self._where.get(name)
        if path is None:
            raise MusicModelError(f"{self.folder}: the checkpoint has no tensor {name!r}")
        handle = self._open[path]
        if handle.tensors[name].dtype not in DTYPES:
            raise MusicModelError(f"{path}: {name} has dtype {handle.tensors[name].dtype}")
        return handle.view(name)

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The tensor in the compute dtype on the device, its shape checked when given."""
        t = self.raw(name)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise MusicModelError(
                f"{self.folder}: {name} has shape {tuple(t.shape)}, the config says {shape}"
            )
        # a copy (never the read-only mapping itself): modules may keep and reshape it
        return t.to(device=self.device, dtype=self.dtype, copy=True)

    def first(self, *names: str) -> str:
        """The first of `names` the checkpoint holds (checkpoints spell some keys two ways)."""
        for name in names:
            if name in self._where:
                return name
        raise MusicModelError(f"{self.folder}: the checkpoint has none of {', '.join(names)}")
