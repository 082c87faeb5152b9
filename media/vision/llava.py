"""The `mlp` mmproj projector: LLaVA-1.5 and LLaVA-1.6 (CLIP tower + a two-layer MLP).

The image goes through the CLIP tower (`clip.Tower`) as the file stores it: llama.cpp's LLaVA
converter keeps the blocks up to the feature layer transformers reads (`vision_feature_layer`
-2: every block but the last, no post-layernorm), so the tower's output is those features. The
class token is dropped (`vision_feature_select_strategy = "default"`) and every patch feature
goes through `mm.0` -> GELU -> `mm.2`. The text width comes from `mm.2`'s weight (the files'
`projection_dim` is CLIP's own, not the text model's).

LLaVA-1.6 (LLaVA-NeXT) files add grid pinpoints (`clip.vision.image_grid_pinpoints`, pairs of
height, width) and `model.image_newline`: an image is a base view plus a grid of tiles
(`llava_processor`); as transformers' `pack_image_features` (`spatial_unpad`), the tiles'
features are laid out as one feature map, the rows and columns that only cover padding are
cut off, a newline vector ends every row, and the base view's features come first.
Multi-layer features (`clip.vision.feature_layer`) are refused with a clear error.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from localllm.engine.layers.linear import QuantLinear, dense
from localllm.media.vision.clip import ClipArgs, Tower
from localllm.media.vision.idefics3 import _triple
from localllm.media.vision.siglip import VisionConfigError


@dataclass(frozen=True)
class ModelArgs:
    clip: ClipArgs
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    out_dim: int = 0  # the text width: known once `mm.2` is loaded
    pinpoints: tuple[tuple[int, int], ...] = ()  # LLaVA-1.6: the grid resolutions, (h, w)

    @property
    def tower(self):
        return self.clip.tower

    @property
    def tokens_per_image(self) -> int:
        return self.tower.patches_per_side**2

    @classmethod
    def from_gguf(cls, meta: dict[str, Any]) -> "ModelArgs":
        layers = meta.get("clip.vision.feature_layer")
        clip = ClipArgs.from_gguf(meta)
        pinpoints = _pinpoints(meta, clip.tower.image_size)
        if layers is not None and list(np.atleast_1d(layers)) != [clip.tower.n_layers]:
            raise VisionConfigError(
                f"clip.vision.feature_layer {layers!r}: features from several layers are not "
                "supported"
            )
        mean, std = _triple(meta, "clip.vision.image_mean"), _triple(meta, "clip.vision.image_std")
        return cls(clip, mean, std, pinpoints=pinpoints)


MAX_PINPOINTS = 64
MAX_TILES = 36  # tiles of one grid resolution (LLaVA-1.6's largest is 2 x 2, or 1 x 3)


def _pinpoints(meta: dict[str, Any], tile: int) -> tuple[tuple[int, int], ...]:
    flat = meta.get("clip.vision.image_grid_pinpoints")
    if flat is None:
        return ()
    merge = meta.get("clip.vision.mm_patch_merge_type", "spatial_unpad")
    if merge != "spatial_unpad":
        raise VisionConfigError(f"mm_patch_merge_type {merge!r} is not supported (spatial_unpad)")
    vals = [int(v) for v in np.atleast_1d(flat)]
    pairs = tuple(zip(vals[0::2], vals[1::2], strict=False))
    if (
        not pairs
        or len(vals) % 2
        or len(pairs) > MAX_PINPOINTS
        or any(
            h < tile or w < tile or h % tile or w % tile or (h // tile) * (w // tile) > MAX_TILES
            for h, w in pairs
        )
    ):
        raise VisionConfigError(
            f"clip.vision.image_grid_pinpoints {vals[:12]!r}: expected (height, width) pairs, "
            f"multiples of the {tile}-px tile, at most {MAX_TILES} tiles each"
        )
    return pairs


class Newline(nn.Module):
    """`model.image_newline`: the vector that ends each row of a LLaVA-1.6 image's tiles."""

    def __init__(self):
        super().__init__()
        self.value: torch.Tensor | None = None

    def load_tensor(self, suffix: str, w) -> None:
        if suffix != "image_newline" or len(w.shape) != 1:
            raise ValueError(f"expected image_newline, a vector, got {suffix} {tuple(w.shape)}")
        self.value = dense(w)

    @property
    def loaded(self) -> bool:
        return self.value is not None


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
        self.model = Newline() if args.pinpoints else None
        self.takes_layout = bool(args.pinpoints)  # the pipeline passes the tile layout

    @property
    def args(self) -> ModelArgs:
        return dataclasses.replace(self._args, out_dim=self.mm["2"].out_features)

    def forward(self, pixels: torch.Tensor, layout=None) -> torch.Tensor:
        """Images [N, 3, S, S] -> embeddings [N * tokens_per_image, text dim]; LLaVA-1.6: one
        image's base view and tiles [1 + rows * cols, 3, S, S] with its `layout`."""
        x = self.v(pixels)[:, 1:]  # the class token is not an image token
        y = self.mm["2"](F.gelu(self.mm["0"](x)))
        if layout is None:
            return y.reshape(-1, y.shape[-1])
        return pack(y, layout, self.args.tower.patches_per_side, self.model.value.to(y))


def pack(y: torch.Tensor, layout, side: int, newline: torch.Tensor) -> torch.Tensor:
    """transformers' LLaVA-NeXT `pack_image_features` for one image: the base view's features,
    then the tiles' feature map without its padding, a newline after every row."""
    d = y.shape[-1]
    grid = y[1:].view(layout.rows, layout.cols, side, side, d)
    grid = grid.permute(4, 0, 2, 1, 3).reshape(d, layout.rows * side, layout.cols * side)
    top, bottom, left, right = unpad_box(layout.height, layout.width, *grid.shape[1:])
    grid = grid[:, top:bottom, left:right]
    rows = torch.cat([grid, newline[:, None, None].expand(d, grid.shape[1], 1)], 2)
    return torch.cat([y[0], rows.flatten(1).transpose(0, 1)])


def unpad_box(h: int, w: int, cur_h: int, cur_w: int) -> tuple[int, int, int, int]:
    """The rows [top, bottom) and columns [left, right) of a cur_h x cur_w feature map that
    cover an h x w image fitted in it (transformers' `unpad_image`, its rounding kept)."""
    if w / h > cur_w / cur_h:
        pad = (cur_h - int(round(h * (cur_w / w), 7))) // 2
        return pad, cur_h - pad, 0, cur_w
    pad = (cur_w - int(round(w * (cur_h / h), 7))) // 2
    return 0, cur_h, pad, cur_w - pad
