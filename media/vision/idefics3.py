"""The `idefics3` mmproj projector: SmolVLM / SmolVLM2 / Idefics3 (SigLIP tower + pixel shuffle).

Each tile goes through the SigLIP tower (`siglip.Tower`, tensors `v.*`); its patch grid is then
pixel-shuffled (every `scale` x `scale` neighbourhood becomes one vector `scale^2` times wider,
in transformers' `Idefics3Connector.pixel_shuffle` order) and projected to the text model's width
by `mm.model.fc` (no bias). A tile of (S/p)^2 patches yields (S/p)^2 / scale^2 embeddings, in
order: the image's tiles row by row, then its global (downscaled) view.
"""

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from localllm.engine.layers.linear import QuantLinear
from localllm.media.vision.siglip import Tower, TowerArgs, VisionConfigError

MAX_SCALE = 8


@dataclass(frozen=True)
class ModelArgs:
    tower: TowerArgs
    scale: int  # pixel-shuffle factor
    out_dim: int  # the text model's embedding width
    preproc_size: int  # the processor's resize target (longest edge), pixels
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]

    @property
    def tokens_per_tile(self) -> int:
        return self.tower.patches_per_side**2 // self.scale**2

    @classmethod
    def from_gguf(cls, meta: dict[str, Any]) -> "ModelArgs":
        tower = TowerArgs.from_gguf(meta)
        scale = meta.get("clip.vision.projector.scale_factor", 2)
        if type(scale) is not int or not 1 <= scale <= MAX_SCALE:
            raise VisionConfigError(f"projector.scale_factor is {scale!r}, expected 1..{MAX_SCALE}")
        if tower.patches_per_side % scale:
            raise VisionConfigError(
                f"projector.scale_factor {scale} does not divide the {tower.patches_per_side} "
                "patches of a tile side"
            )
        out_dim = meta.get("clip.vision.projection_dim")
        if type(out_dim) is not int or out_dim < 1:
            raise VisionConfigError(f"clip.vision.projection_dim is {out_dim!r}")
        size = meta.get("clip.vision.preproc_image_size", 4 * tower.image_size)
        if type(size) is not int or not tower.image_size <= size <= 16 * tower.image_size:
            raise VisionConfigError(f"clip.vision.preproc_image_size is {size!r}")
        return cls(
            tower, scale, out_dim, size,
            _triple(meta, "clip.vision.image_mean"), _triple(meta, "clip.vision.image_std"),
        )  # fmt: skip


def _triple(meta: dict[str, Any], key: str) -> tuple[float, float, float]:
    v = meta.get(key)
    try:
        a = np.asarray(v, dtype=np.float64)
    except (TypeError, ValueError):
        a = None
    if a is None or a.shape != (3,) or not np.isfinite(a).all():
        raise VisionConfigError(f"'{key}' is {v!r}, expected three numbers")
    if key.endswith("std") and not (a > 0).all():
        raise VisionConfigError(f"'{key}' must be positive, got {a.tolist()}")
    # the GGUF stores float32: these are the values transformers' processor config held
    return tuple(float(np.float32(x)) for x in a)


class Projector(nn.Module):
    """`mm.model.fc`: the connector's one linear layer."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.fc = QuantLinear(in_dim, out_dim)


class Connector(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.model = Projector(a.tower.dim * a.scale**2, a.out_dim)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.v = Tower(args.tower)
        self.mm = Connector(args)
        self.position_ids = _position_ids(args.tower.patches_per_side)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Tiles [T, 3, S, S] -> embeddings [T * tokens_per_tile, out_dim]."""
        ids = self.position_ids.to(pixels.device)
        x = self.v(pixels, ids)
        x = pixel_shuffle(x, self.args.scale)
        return self.mm.model.fc(x).reshape(-1, self.args.out_dim)


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[T, n*n, d] -> [T, n*n / scale^2, d * scale^2], as transformers' Idefics3 connector."""
    t, seq, d = x.shape
    side = round(seq**0.5)
    x = x.view(t, side, side // scale, d * scale).permute(0, 2, 1, 3)
    x = x.reshape(t, side // scale, side // scale, d * scale * scale).permute(0, 2, 1, 3)
    return x.reshape(t, seq // scale**2, d * scale * scale)


def _position_ids(n: int) -> torch.Tensor:
    """The patch position ids transformers computes for a full tile: fractional coordinates
    bucketized against its boundaries (in float32, so any rounding it makes, we make)."""
    boundaries = torch.arange(1 / n, 1.0, 1 / n)
    step = 1.0 / torch.tensor(n)
    frac = torch.clamp(torch.arange(n, dtype=torch.float32) * step, max=1.0 - 1e-6)
    b = torch.bucketize(frac, boundaries, right=True)
    return (b[:, None] * n + b[None, :]).reshape(-1)
