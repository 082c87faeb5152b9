"""The `qwen3vl_merger` mmproj projector: Qwen3-VL's vision transformer, merger and deepstack.

Input is the processor's flat patches [N, 3 * 2 * p * p] (p = 16) with their grid (t, h, w), in
merge-block order. The 3-D conv patch embedding (split per frame by llama.cpp's converter, with
a bias) is added to learned positions (`v.position_embd`, a square table resampled bilinearly,
corners aligned, to the image's patch grid, as transformers' `fast_pos_embed_interpolate`).
Blocks: LayerNorm (`ln1`) -> attention with fused `attn_qkv` and the 2-D rope of Qwen2.5-VL over
each frame -> residual; LayerNorm (`ln2`) -> tanh-GELU MLP (`ffn_up`, `ffn_down`) -> residual.
The merger normalizes each patch (`v.post_ln`), joins 2x2 merge blocks and projects them
(`mm.0` -> GELU -> `mm.2`). After the blocks flagged by `clip.vision.is_deepstack_layers`, a
deepstack merger (`v.deepstack.N`: join, LayerNorm, fc1 -> GELU -> fc2) makes one more
embedding per merged unit; the text model adds it to its hidden states after its first layers.
Output: [tokens, dim * (1 + deepstack layers)], the main embedding first (llama.cpp's layout).
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from localllm.engine.layers.linear import QuantLinear, dense
from localllm.engine.models.bert import LayerNorm
from localllm.media.vision.idefics3 import _triple
from localllm.media.vision.qwen25vl import (
    MERGE,
    Groups,
    PatchEmbedding,
    _patch_grid,
    _rope,
    rope_2d,
    rope_2d_freqs,
)
from localllm.media.vision.siglip import (
    MAX_BLOCKS,
    MAX_DIM,
    VisionConfigError,
    _int,
    gelu_tanh_,
    residual,
)
from localllm.offload import QuantWeight

MERGER_EPS = 1e-6  # transformers' Qwen3VLVisionPatchMerger


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    patch_size: int
    norm_eps: float
    out_dim: int
    deepstack: tuple[int, ...]  # blocks whose output feeds a deepstack merger, in order
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]

    @classmethod
    def from_gguf(cls, meta: dict[str, Any]) -> "ModelArgs":
        n_layers = _int(meta, "clip.vision.block_count", MAX_BLOCKS)
        flags = list(meta.get("clip.vision.is_deepstack_layers", []))
        if len(flags) not in (0, n_layers):
            raise VisionConfigError(
                f"clip.vision.is_deepstack_layers has {len(flags)} flags for {n_layers} blocks"
            )
        args = cls(
            dim=_int(meta, "clip.vision.embedding_length", MAX_DIM),
            hidden_dim=_int(meta, "clip.vision.feed_forward_length", 4 * MAX_DIM),
            n_layers=n_layers,
            n_heads=_int(meta, "clip.vision.attention.head_count", MAX_DIM),
            patch_size=_int(meta, "clip.vision.patch_size", 1024),
            norm_eps=float(meta.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
            out_dim=_int(meta, "clip.vision.projection_dim", MAX_DIM),
            deepstack=tuple(i for i, f in enumerate(flags) if f),
            image_mean=_triple(meta, "clip.vision.image_mean"),
            image_std=_triple(meta, "clip.vision.image_std"),
        )
        if args.dim % args.n_heads or (args.dim // args.n_heads) % 4:
            raise VisionConfigError(
                f"clip.vision.attention.head_count {args.n_heads} does not split embedding_length "
                f"{args.dim} into heads whose size 2-D rope can halve twice"
            )
        merge = meta.get("clip.vision.spatial_merge_size", MERGE)
        if merge != MERGE:
            raise VisionConfigError(f"clip.vision.spatial_merge_size {merge} is not 2")
        return args


class PositionEmbedding(nn.Module):
    """`v.position_embd`: a side x side table of learned positions."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.weight: torch.Tensor | None = None

    def load_tensor(self, suffix: str, w: QuantWeight) -> None:
        n = w.shape[0] if len(w.shape) == 2 else 0
        if suffix != "weight" or n < 1 or round(n**0.5) ** 2 != n or w.shape[1] != self.dim:
            raise ValueError(f"expected a square position_embd of width {self.dim}, got {w.shape}")
        self.weight = dense(w)

    @property
    def loaded(self) -> bool:
        return self.weight is not None

    def resampled(self, rows: torch.Tensor, cols: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """The table bilinearly resampled (corners aligned) at patch (row, col) of an h x w grid."""
        side = round(self.weight.shape[0] ** 0.5)
        (h0, h1), (hw0, hw1) = _taps(rows, h, side)
        (w0, w1), (ww0, ww1) = _taps(cols, w, side)
        t = self.weight
        return (
            t[h0 * side + w0] * (hw0 * ww0)[:, None]
            + t[h0 * side + w1] * (hw0 * ww1)[:, None]
            + t[h1 * side + w0] * (hw1 * ww0)[:, None]
            + t[h1 * side + w1] * (hw1 * ww1)[:, None]
        )


def _taps(index: torch.Tensor, size: int, side: int):
    """transformers' `_interpolation_axis_taps_weights` (bilinear, align_corners, border)."""
    src = index.to(torch.float32) * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    lo = floor.long().clamp(0, side - 1)
    hi = (floor.long() + 1).clamp(0, side - 1)
    w0 = (1 - (src - floor).abs()).clamp(min=0)
    w1 = (1 - (src - floor - 1).abs()).clamp(min=0)
    return (lo, hi), (w0, w1)


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_heads = a.n_heads
        self.ln1 = LayerNorm(a.dim, a.norm_eps)
        self.attn_qkv = QuantLinear(a.dim, 3 * a.dim)
        self.attn_out = QuantLinear(a.dim, a.dim)
        self.ln2 = LayerNorm(a.dim, a.norm_eps)
        self.ffn_up = QuantLinear(a.dim, a.hidden_dim)
        self.ffn_down = QuantLinear(a.hidden_dim, a.dim)

    def forward(self, x, cos, sin, groups: Groups) -> torch.Tensor:
        n, d = x.shape
        qkv = self.attn_qkv(self.ln1(x)).view(n, 3, self.n_heads, d // self.n_heads)
        q, k, v = (qkv[:, i].transpose(0, 1) for i in range(3))
        q, k = _rope(q, cos, sin).to(v.dtype), _rope(k, cos, sin).to(v.dtype)
        o = groups.attend(q, k, v)
        x = residual(x, self.attn_out(o.transpose(0, 1).reshape(n, d)))
        return residual(x, self.ffn_down(gelu_tanh_(self.ffn_up(self.ln2(x)))))


class Merger(nn.Module):
    """Join 2x2 merge blocks, then fc1 -> GELU -> fc2 (`norm` after the join: deepstack)."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        wide = a.dim * MERGE * MERGE
        self.norm = LayerNorm(wide, MERGER_EPS)
        self.fc1 = QuantLinear(wide, wide)
        self.fc2 = QuantLinear(wide, a.out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.reshape(-1, self.fc1.in_features))
        return self.fc2(F.gelu(self.fc1(x)))


class Projector(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        wide = a.dim * MERGE * MERGE
        self.add_module("0", QuantLinear(wide, wide))
        self.add_module("2", QuantLinear(wide, a.out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, "2")(F.gelu(getattr(self, "0")(x)))


class Tower(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.patch_embd = PatchEmbedding(a.dim, a.patch_size)
        self.position_embd = PositionEmbedding(a.dim)
        self.blk = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.post_ln = LayerNorm(a.dim, a.norm_eps)
        self.deepstack = nn.ModuleDict({str(i): Merger(a) for i in a.deepstack})


class Model(nn.Module):
    takes_grid = True  # forward needs the (t, h, w) patch grid beside the pixels

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.v = Tower(args)
        self.mm = Projector(args)
        self.inv_freq = rope_2d_freqs(args.dim, args.n_heads)

    def forward(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """Patches [t*h*w, 3*2*p*p] -> embeddings [t*h*w / 4, out_dim * (1 + deepstack)]."""
        a = self.args
        t, h, w = grid
        dev = patches.device
        rows, cols, frame, _ = (g.to(dev) for g in _patch_grid(t, h, w, max(h, w)))
        cos, sin = rope_2d(self.inv_freq, rows, cols)
        frames = Groups.of(frame)  # each frame on its own
        x = self.v.patch_embd(patches)
        x = x + self.v.position_embd.resampled(rows, cols, h, w).to(x.dtype)
        deep = []
        for i, blk in enumerate(self.v.blk):
            x = blk(x, cos, sin, frames)
            if str(i) in self.v.deepstack:
                deep.append(self.v.deepstack[str(i)](x))
        main = self.mm(self.v.post_ln(x).reshape(-1, a.dim * MERGE * MERGE))
        return torch.cat([main, *deep], 1)
