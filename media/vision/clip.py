"""The CLIP vision transformer that LLaVA-family mmproj files store under `v.*`.

Patch embedding (a strided conv without bias, `v.patch_embd`), a learned class token
(`v.class_embd`) in front, learned positions for it and every patch (`v.position_embd`), a
LayerNorm before the blocks (`v.pre_ln`), then SigLIP-shaped blocks (`siglip.Block`'s tensors)
with CLIP's activation: quick GELU (x * sigmoid(1.702 x)) unless `clip.use_gelu`; an optional
final LayerNorm (`v.post_ln`, absent from LLaVA files: they stop where the features are taken).

llama.cpp's legacy LLaVA converter names the first MLP matrix `ffn_down` and the second
`ffn_up`; each MLP linear here takes its orientation from the weight it is given (`FlexLinear`),
as llama.cpp's loader does, so both namings load.
"""

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from localllm.engine.layers.linear import QuantLinear, dense
from localllm.engine.models.bert import LayerNorm
from localllm.media.vision.siglip import Block as SiglipBlock
from localllm.media.vision.siglip import PatchEmbedding, PositionEmbedding, TowerArgs, residual
from localllm.offload import QuantWeight


@dataclass(frozen=True)
class ClipArgs:
    tower: TowerArgs
    gelu: bool  # exact GELU; else quick GELU (CLIP's own)

    @classmethod
    def from_gguf(cls, meta: dict[str, Any]) -> "ClipArgs":
        return cls(TowerArgs.from_gguf(meta), bool(meta.get("clip.use_gelu", False)))


class FlexLinear(QuantLinear):
    """A linear that takes its orientation from its weight (or bias): a legacy file may give
    it its partner's matrix."""

    def load_tensor(self, suffix: str, w: QuantWeight) -> None:
        rows = math.prod(w.shape) if suffix == "bias" else w.shape[0]
        fresh = self.weight is None and self.bias is None
        if fresh and rows != self.out_features and rows == self.in_features:
            self.in_features, self.out_features = self.out_features, self.in_features
        super().load_tensor(suffix, w)


class Block(SiglipBlock):
    def __init__(self, a: TowerArgs, gelu: bool):
        super().__init__(a)
        self.gelu = gelu
        self.hidden = a.hidden_dim
        self.ffn_up = FlexLinear(a.dim, a.hidden_dim)
        self.ffn_down = FlexLinear(a.hidden_dim, a.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, n, d = x.shape
        h = self.ln1(x)

        def heads(y):
            return y.view(t, n, self.n_heads, d // self.n_heads).transpose(1, 2)

        q, k, v = heads(self.attn_q(h)), heads(self.attn_k(h)), heads(self.attn_v(h))
        o = F.scaled_dot_product_attention(q, k, v)  # every position sees every other
        x = residual(x, self.attn_out(o.transpose(1, 2).reshape(t, n, d)))
        first, second = self.ffn_up, self.ffn_down
        if first.out_features != self.hidden:  # the legacy naming
            first, second = second, first
        y = first(self.ln2(x))
        y = F.gelu(y) if self.gelu else y * torch.sigmoid(1.702 * y)
        return residual(x, second(y))


class Tower(nn.Module):
    """The `v.*` tensors: images [N, 3, S, S] -> [N, 1 + (S/p)^2, dim] (class token first)."""

    def __init__(self, a: ClipArgs, post_ln: bool = False):
        super().__init__()
        t = a.tower
        self.args = a
        self.class_embd: torch.Tensor | None = None  # `v.class_embd`: a bare tensor name
        self.patch_embd = PatchEmbedding(t.dim, t.patch_size)
        self.position_embd = PositionEmbedding(t.patches_per_side**2 + 1, t.dim)
        self.pre_ln = LayerNorm(t.dim, t.norm_eps)
        self.blk = nn.ModuleList(Block(t, a.gelu) for _ in range(t.n_layers))
        self.post_ln = LayerNorm(t.dim, t.norm_eps) if post_ln else None

    def load_tensor(self, suffix: str, w: QuantWeight) -> None:
        dim = self.args.tower.dim
        if suffix != "class_embd" or math.prod(w.shape) != dim:
            raise ValueError(f"expected class_embd of ({dim},), got {suffix} {tuple(w.shape)}")
        self.class_embd = dense(w).reshape(dim)

    @property
    def loaded(self) -> bool:
        return self.class_embd is not None

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embd(pixels)  # bias-less in CLIP: PatchEmbedding adds None
        cls = self.class_embd.to(patches.dtype).expand(patches.shape[0], 1, -1)
        x = torch.cat([cls, patches], 1) + self.position_embd.weight
        x = self.pre_ln(x)
        for blk in self.blk:
            x = blk(x)
        return x if self.post_ln is None else self.post_ln(x)
