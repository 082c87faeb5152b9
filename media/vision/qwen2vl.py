"""The `qwen2vl_merger` mmproj projector: Qwen2-VL's vision transformer and patch merger.

Qwen2.5-VL's tower (`qwen25vl`: the per-frame split 3-D conv, 2-D rope, merge blocks of 2x2
patches) with Qwen2-VL's blocks: LayerNorm (`ln1`, `ln2`, with biases), attention over the
whole frame (no windows), and a quick-GELU MLP (`ffn_up` -> x * sigmoid(1.702 x) -> `ffn_down`);
the merger normalizes with a LayerNorm (`v.post_ln`) before `mm.0` -> GELU -> `mm.2`.
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from localllm.engine.layers.linear import QuantLinear
from localllm.engine.models.bert import LayerNorm
from localllm.media.vision.idefics3 import _triple
from localllm.media.vision.qwen25vl import (
    MERGE,
    Groups,
    PatchEmbedding,
    Projector,
    _patch_grid,
    _rope,
    rope_2d,
    rope_2d_freqs,
)
from localllm.media.vision.siglip import MAX_BLOCKS, MAX_DIM, VisionConfigError, _int, residual


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    patch_size: int
    norm_eps: float
    out_dim: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]

    @classmethod
    def from_gguf(cls, meta: dict[str, Any]) -> "ModelArgs":
        args = cls(
            dim=_int(meta, "clip.vision.embedding_length", MAX_DIM),
            hidden_dim=_int(meta, "clip.vision.feed_forward_length", 4 * MAX_DIM),
            n_layers=_int(meta, "clip.vision.block_count", MAX_BLOCKS),
            n_heads=_int(meta, "clip.vision.attention.head_count", MAX_DIM),
            patch_size=_int(meta, "clip.vision.patch_size", 1024),
            norm_eps=float(meta.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
            out_dim=_int(meta, "clip.vision.projection_dim", MAX_DIM),
            image_mean=_triple(meta, "clip.vision.image_mean"),
            image_std=_triple(meta, "clip.vision.image_std"),
        )
        if args.dim % args.n_heads or (args.dim // args.n_heads) % 4:
            raise VisionConfigError(
                f"clip.vision.attention.head_count {args.n_heads} does not split embedding_length "
                f"{args.dim} into heads whose size 2-D rope can halve twice"
            )
        if not 0 < args.norm_eps < 1:
            raise VisionConfigError(f"layer_norm_epsilon {args.norm_eps} is out of range")
        return args


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_heads = a.n_heads
        self.ln1 = LayerNorm(a.dim, a.norm_eps)
        self.attn_q = QuantLinear(a.dim, a.dim)
        self.attn_k = QuantLinear(a.dim, a.dim)
        self.attn_v = QuantLinear(a.dim, a.dim)
        self.attn_out = QuantLinear(a.dim, a.dim)
        self.ln2 = LayerNorm(a.dim, a.norm_eps)
        self.ffn_up = QuantLinear(a.dim, a.hidden_dim)
        self.ffn_down = QuantLinear(a.hidden_dim, a.dim)

    def forward(self, x, cos, sin, groups: Groups) -> torch.Tensor:
        n, d = x.shape
        h = self.ln1(x)

        def heads(y):
            return y.view(n, self.n_heads, d // self.n_heads).transpose(0, 1)

        q, k, v = heads(self.attn_q(h)), heads(self.attn_k(h)), heads(self.attn_v(h))
        q, k = _rope(q, cos, sin).to(v.dtype), _rope(k, cos, sin).to(v.dtype)
        o = groups.attend(q, k, v)
        x = residual(x, self.attn_out(o.transpose(0, 1).reshape(n, d)))
        u = self.ffn_up(self.ln2(x))
        return residual(x, self.ffn_down(u * torch.sigmoid(1.702 * u)))  # quick GELU


class Tower(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.patch_embd = PatchEmbedding(a.dim, a.patch_size)
        self.blk = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.post_ln = LayerNorm(a.dim, a.norm_eps)


class Model(nn.Module):
    takes_grid = True  # forward needs the (t, h, w) patch grid beside the pixels

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.v = Tower(args)
        self.mm = Projector(args)
        self.inv_freq = rope_2d_freqs(args.dim, args.n_heads)

    def forward(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """Patches [t*h*w, 3*2*p*p] -> embeddings [t*h*w / 4, out_dim]."""
        a = self.args
        t, h, w = grid
        dev = patches.device
        rows, cols, frame, _ = (g.to(dev) for g in _patch_grid(t, h, w, max(h, w)))
        cos, sin = rope_2d(self.inv_freq, rows, cols)
        frames = Groups.of(frame)
        x = self.v.patch_embd(patches)
        for blk in self.v.blk:
            x = blk(x, cos, sin, frames)
        return self.mm(self.v.post_ln(x).reshape(-1, a.dim * MERGE * MERGE))
