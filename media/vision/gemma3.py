"""The `gemma3` mmproj projector: Gemma 3's SigLIP tower and its pooled soft-token projector.

One square image goes through the SigLIP tower (`siglip.Tower`, tensors `v.*`, patch positions
0..n-1 in row-major order); its patch grid is average-pooled in `scale` x `scale` windows
(transformers' `Gemma3MultiModalProjector.avg_pool`; 64 x 64 patches -> 16 x 16 = 256 tokens for
the released 896-px tower), RMS-normalized by `mm.soft_emb_norm` (the converter folds Gemma's
1 + w into the weight) and multiplied by `mm.input_projection` [vision dim, text dim]. The
converter always writes that projection as F16 (llama.cpp issue 13025); it is read once to
float32 (a few MB for the released models) since it is stored transposed for `QuantLinear`.
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from localllm.engine.layers.linear import dense
from localllm.media.vision.idefics3 import _triple
from localllm.media.vision.siglip import Tower, TowerArgs, VisionConfigError
from localllm.offload import QuantWeight

DEFAULT_SCALE = 4  # llama.cpp writes the pooling factor only when it is not 4


@dataclass(frozen=True)
class ModelArgs:
    tower: TowerArgs
    scale: int  # average-pool window (and stride), in patches
    out_dim: int  # the text model's embedding width
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]

    @property
    def tokens_per_image(self) -> int:
        return (self.tower.patches_per_side // self.scale) ** 2

    @classmethod
    def from_gguf(cls, meta: dict[str, Any]) -> "ModelArgs":
        tower = TowerArgs.from_gguf(meta)
        scale = meta.get("clip.vision.projector.scale_factor", DEFAULT_SCALE)
        if type(scale) is not int or not 1 <= scale <= tower.patches_per_side:
            raise VisionConfigError(f"projector.scale_factor is {scale!r}")
        if tower.patches_per_side % scale:
            raise VisionConfigError(
                f"projector.scale_factor {scale} does not divide the {tower.patches_per_side} "
                "patches of an image side"
            )
        out_dim = meta.get("clip.vision.projection_dim")
        if type(out_dim) is not int or out_dim < 1:
            raise VisionConfigError(f"clip.vision.projection_dim is {out_dim!r}")
        return cls(
            tower, scale, out_dim,
            _triple(meta, "clip.vision.image_mean"), _triple(meta, "clip.vision.image_std"),
        )  # fmt: skip


class SoftEmbNorm(nn.Module):
    """`mm.soft_emb_norm`: RMSNorm in float32 with the (1 + w) weight as stored."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight: torch.Tensor | None = None
        self.dim = dim

    def load_tensor(self, suffix: str, w: QuantWeight) -> None:
        if suffix != "weight" or tuple(w.shape) != (self.dim,):
            raise ValueError(f"expected soft_emb_norm weight of ({self.dim},), got {w.shape}")
        self.weight = dense(w)

    @property
    def loaded(self) -> bool:
        return self.weight is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class InputProjection(nn.Module):
    """`mm.input_projection`: y = x @ W with W [vision dim, text dim] (not transposed)."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.shape = (in_dim, out_dim)
        self.weight: torch.Tensor | None = None

    def load_tensor(self, suffix: str, w: QuantWeight) -> None:
        if suffix != "weight" or tuple(w.shape) != self.shape:
            raise ValueError(f"expected input_projection of {self.shape}, got {tuple(w.shape)}")
        self.weight = dense(w)

    @property
    def loaded(self) -> bool:
        return self.weight is not None


class Projector(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.soft_emb_norm = SoftEmbNorm(a.tower.dim, a.tower.norm_eps)
        self.input_projection = InputProjection(a.tower.dim, a.out_dim)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.v = Tower(args.tower)
        self.mm = Projector(args)
        self.position_ids = torch.arange(args.tower.patches_per_side**2)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Images [N, 3, S, S] -> embeddings [N * tokens_per_image, out_dim]."""
        x = self.v(pixels, self.position_ids.to(pixels.device))  # [N, n*n, d]
        n, _, d = x.shape
        side = self.args.tower.patches_per_side
        grid = x.transpose(1, 2).reshape(n, d, side, side)
        pooled = F.avg_pool2d(grid, self.args.scale).flatten(2).transpose(1, 2)
        y = self.mm.soft_emb_norm(pooled) @ self.mm.input_projection.weight
        return y.reshape(-1, self.args.out_dim)
