"""The `mlp` mmproj projector: LLaVA-1.5 (CLIP tower + a two-layer MLP).

The image goes through the CLIP tower (`clip.Tower`) as the file stores it: llama.cpp's LLaVA
converter keeps the blocks up to the feature layer transformers reads (`vision_feature_layer`
-2: every block but the last, no post-layernorm), so the tower's output is those features. The
class token is dropped (`vision_feature_select_strategy = "default"`) and every patch feature
goes through `mm.0` -> GELU -> `mm.2`. The text width comes from `mm.2`'s weight (the files'
`projection_dim` is CLIP's own, not the text model's).

LLaVA-1.6 files (`clip.vision.image_grid_pinpoints`, anyres tiling with `model.image_newline`)
and multi-layer features (`clip.vision.feature_layer`) are refused with a clear error.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from localllm.engine.layers.linear import QuantLinear
from localllm.media.vision.clip import ClipArgs, Tower
from localllm.media.vision.idefics3 import _triple
from localllm.media.vision.siglip import VisionConfigError


@dataclass(frozen=True)
class ModelArgs:
    clip: ClipArgs
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    out_dim: int = 0  # the text width: known once `mm.2` is loaded

    @property
    def tower(self):
        return self.clip.tower

    @property
    def tokens_per_image(self) -> int:
        return self.tower.patches_per_side**2

    @classmethod
    def from_gguf(cls, meta: dict[str, Any]) -> "ModelArgs":
        if meta.get("clip.vision.image_grid_pinpoints") is not None:
            raise VisionConfigError(
                "this is a LLaVA-1.6 (anyres) projector: its image tiling is not supported yet "
                "(LLaVA-1.5 files are)"
            )
        layers = meta.get("clip.vision.feature_layer")
        clip = ClipArgs.from_gguf(meta)
        if layers is not None and list(np.atleast_1d(layers)) != [clip.tower.n_layers]:
            raise VisionConfigError(
                f"clip.vision.feature_layer {layers!r}: features from several layers are not "
                "supported"
            )
        return cls(
            clip, _triple(meta, "clip.vision.image_mean"), _triple(meta, "clip.vision.image_std")
        )


class FreeLinear(QuantLinear):
    """A projector linear whose widths come from its weight (`mm.0`, `mm.2`)."""

    def load_tensor(self, suffix, w) -> None:
        if suffix == "weight" and len(w.shape) == 2:
            self.out_features, self.in_features = w.shape
        elif suffix == "bias" and self.weight is None:
            self.out_features = int(np.prod(w.shape))
        super().load_tensor(suffix, w)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self._args = args
        self.v = Tower(args.clip)
        d = args.tower.dim
        # mm.0 and mm.2 (mm.1 is the activation); widths follow their weights
        self.mm = nn.ModuleDict({"0": FreeLinear(d, d), "2": FreeLinear(d, d)})

    @property
    def args(self) -> ModelArgs:
        return dataclasses.replace(self._args, out_dim=self.mm["2"].out_features)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Images [N, 3, S, S] -> embeddings [N * tokens_per_image, text dim]."""
        x = self.v(pixels)[:, 1:]  # the class token is not an image token
        y = self.mm["2"](F.gelu(self.mm["0"](x)))
        return y.reshape(-1, y.shape[-1])
