"""The SigLIP vision transformer that mmproj files store under `v.*` (SmolVLM/Idefics3, Gemma 3).

Patch embedding (a strided conv, `v.patch_embd`), learned positions (`v.position_embd`), then
per block: LayerNorm (`ln1`) -> multi-head self-attention over all patches of a tile (`attn_q/k/v`
with biases, `attn_out`) -> residual; LayerNorm (`ln2`) -> tanh-GELU MLP (`ffn_up`, `ffn_down`)
-> residual; a final LayerNorm (`v.post_ln`). Tiles are a batch: [tiles, 3, S, S] in,
[tiles, patches, dim] out. Linear weights stay in their ggml encoding (`QuantLinear`).

`Tower.use_half` runs the blocks' linears and attention in float16 or bfloat16 (F16 weights
viewed as stored, others copied once): the matmuls on tensor cores and attention through the
flash backend, as llama.cpp's encoder does with F16 weights; the residual stream and the norms
stay float32 (F16: norm outputs saturate at +-65504, `linear_half.half_input`). With
`mmproj.HALF_TOWER` on (the default since its GPU run) it is the default on CUDA where the blocks'
weights are F16 or BF16 (`mmproj.build_tower` calls `use_half(stored_half_dtype())`);
`use_half(None)` gives the float32 blocks (their F16/BF16 linears multiply in half on CUDA with
`kernels.quant.linear.HALF_GEMM` on, `kernels/quant/linear_half.py`). CPU stays float32 (no half
dot products there).
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from localllm.engine.layers.linear import QuantLinear, dense
from localllm.engine.models.bert import LayerNorm
from localllm.kernels.quant.linear_half import half_input
from localllm.kernels.quant.types import QuantType
from localllm.offload import QuantWeight

# Bounds on an mmproj header (untrusted input): far beyond every released tower (SigLIP-so400m:
# 1152 wide, 27 blocks, 16 heads, 896-px tiles), small enough that a hostile value fails fast.
MAX_DIM = 16_384
MAX_BLOCKS = 256
MAX_IMAGE_SIZE = 4_096
HALF_TYPES = {QuantType.F16: torch.float16, QuantType.BF16: torch.bfloat16}  # viewed as stored


def residual(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + y, written into y: y is a block's fresh output (a linear's), and on a CPU every
    further prompt-sized tensor is a new mapping page-faulted afresh (3-9 ms a [5120, 3072]
    float32 tensor here). Same bits: IEEE addition commutes."""
    return y.add_(x) if y.dtype == x.dtype and y.shape == x.shape else x + y


def gelu_tanh_(y: torch.Tensor) -> torch.Tensor:
    """tanh-GELU in place on a linear's fresh output (F.gelu's kernel and bits)."""
    return torch.ops.aten.gelu_(y, approximate="tanh")


class VisionConfigError(ValueError):
    """An mmproj's `clip.vision.*` hyperparameters are missing or out of range."""


@dataclass(frozen=True)
class TowerArgs:
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    image_size: int  # one tile's side, pixels
    patch_size: int
    norm_eps: float

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @classmethod
    def from_gguf(cls, meta: dict[str, Any]) -> "TowerArgs":
        args = cls(
            dim=_int(meta, "clip.vision.embedding_length", MAX_DIM),
            hidden_dim=_int(meta, "clip.vision.feed_forward_length", 4 * MAX_DIM),
            n_layers=_int(meta, "clip.vision.block_count", MAX_BLOCKS),
            n_heads=_int(meta, "clip.vision.attention.head_count", MAX_DIM),
            image_size=_int(meta, "clip.vision.image_size", MAX_IMAGE_SIZE),
            patch_size=_int(meta, "clip.vision.patch_size", MAX_IMAGE_SIZE),
            norm_eps=float(meta.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
        )
        if args.dim % args.n_heads:
            raise VisionConfigError(
                f"clip.vision.attention.head_count {args.n_heads} does not divide "
                f"embedding_length {args.dim}"
            )
        if args.image_size % args.patch_size:
            raise VisionConfigError(
                f"clip.vision.patch_size {args.patch_size} does not divide image_size "
                f"{args.image_size}"
            )
        if not 0 < args.norm_eps < 1:
            raise VisionConfigError(f"layer_norm_epsilon {args.norm_eps} is out of range")
        return args


def _int(meta: dict[str, Any], key: str, top: int) -> int:
    value = meta.get(key)
    if value is None:
        raise VisionConfigError(f"mmproj metadata lacks '{key}'")
    if type(value) is not int or not 1 <= value <= top:
        raise VisionConfigError(f"'{key}' is {value!r}, expected an integer in 1..{top}")
    return value


class PatchEmbedding(nn.Module):
    """`v.patch_embd`: a conv with kernel = stride = patch size, weight [dim, 3, p, p]."""

    def __init__(self, dim: int, patch: int):
        super().__init__()
        self.shape = (dim, 3, patch, patch)
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def load_tensor(self, suffix: str, w: QuantWeight) -> None:
        want = self.shape if suffix == "weight" else self.shape[:1]
        if suffix not in ("weight", "bias") or tuple(w.shape) != want:
            raise ValueError(f"expected patch_embd.{suffix} of {want}, got {tuple(w.shape)}")
        setattr(self, suffix, dense(w))

    @property
    def loaded(self) -> bool:
        return self.weight is not None

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = F.conv2d(pixels, self.weight, self.bias, stride=self.shape[-1])
        return x.flatten(2).transpose(1, 2)  # [tiles, patches, dim], row-major patches


class PositionEmbedding(nn.Module):
    """`v.position_embd`: one learned vector per patch position of a tile."""

    def __init__(self, n: int, dim: int):
        super().__init__()
        self.shape = (n, dim)
        self.weight: torch.Tensor | None = None

    def load_tensor(self, suffix: str, w: QuantWeight) -> None:
        if suffix != "weight" or tuple(w.shape) != self.shape:
            raise ValueError(f"expected position_embd of {self.shape}, got {tuple(w.shape)}")
        self.weight = dense(w)

    @property
    def loaded(self) -> bool:
        return self.weight is not None


LINEARS = ("attn_q", "attn_k", "attn_v", "attn_out", "ffn_up", "ffn_down")


def _half_weight(m: QuantLinear, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W [N, K], bias) of a loaded QuantLinear in `dtype`: the file's own half values as a view
    where they are of that dtype, else dequantized once."""
    w, n = m.weight, m.out_features
    if HALF_TYPES.get(w.qtype) == dtype:
        half = w.data.reshape(n, -1).view(dtype)
    else:
        half = dense(w).reshape(n, m.in_features).to(dtype)
        if not torch.isfinite(half).all():
            raise ValueError(f"{dtype} cannot hold this {w.qtype.name} weight")
    return half, m.bias.to(dtype) if m.bias is not None else None


class Block(nn.Module):
    def __init__(self, a: TowerArgs):
        super().__init__()
        self.n_heads = a.n_heads
        self.half_weights: dict[str, tuple[torch.Tensor, torch.Tensor | None]] | None = None
        self.ln1 = LayerNorm(a.dim, a.norm_eps)
        self.attn_q = QuantLinear(a.dim, a.dim)
        self.attn_k = QuantLinear(a.dim, a.dim)
        self.attn_v = QuantLinear(a.dim, a.dim)
        self.attn_out = QuantLinear(a.dim, a.dim)
        self.ln2 = LayerNorm(a.dim, a.norm_eps)
        self.ffn_up = QuantLinear(a.dim, a.hidden_dim)
        self.ffn_down = QuantLinear(a.hidden_dim, a.dim)

    def use_half(self, dtype: torch.dtype | None) -> None:
        weights = (
            None if dtype is None else {k: _half_weight(getattr(self, k), dtype) for k in LINEARS}
        )
        self.half_weights = weights  # (not `half`: nn.Module.half() is a method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.half_weights is not None:
            return self._forward_half(x)
        t, n, d = x.shape
        h = self.ln1(x)

        def heads(y):
            return y.view(t, n, self.n_heads, d // self.n_heads).transpose(1, 2)

        q, k, v = heads(self.attn_q(h)), heads(self.attn_k(h)), heads(self.attn_v(h))
        o = F.scaled_dot_product_attention(q, k, v)  # every patch sees every patch of its tile
        x = residual(x, self.attn_out(o.transpose(1, 2).reshape(t, n, d)))
        return residual(x, self.ffn_down(gelu_tanh_(self.ffn_up(self.ln2(x)))))

    def _forward_half(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` with the matmuls and attention in the half dtype; x stays float32."""
        t, n, d = x.shape
        w = self.half_weights
        h = half_input(self.ln1(x), w["attn_q"][0].dtype)

        def heads(name):
            return F.linear(h, *w[name]).view(t, n, self.n_heads, d // self.n_heads).transpose(1, 2)

        o = F.scaled_dot_product_attention(heads("attn_q"), heads("attn_k"), heads("attn_v"))
        x = residual(x, F.linear(o.transpose(1, 2).reshape(t, n, d), *w["attn_out"]).float())
        h = half_input(self.ln2(x), h.dtype)
        u = gelu_tanh_(F.linear(h, *w["ffn_up"]))
        return residual(x, F.linear(u, *w["ffn_down"]).float())


class Tower(nn.Module):
    """The `v.*` tensors: tiles [T, 3, S, S] -> patch features [T, (S/p)^2, dim]."""

    def __init__(self, a: TowerArgs):
        super().__init__()
        self.args = a
        self.patch_embd = PatchEmbedding(a.dim, a.patch_size)
        self.position_embd = PositionEmbedding(a.patches_per_side**2, a.dim)
        self.blk = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.post_ln = LayerNorm(a.dim, a.norm_eps)

    def stored_half_dtype(self) -> torch.dtype | None:
        """float16 / bfloat16 where every block linear is stored F16 / BF16, else None."""
        types = {getattr(blk, k).weight.qtype for blk in self.blk for k in LINEARS}
        return HALF_TYPES.get(types.pop()) if len(types) == 1 else None

    def use_half(self, dtype: torch.dtype | None = torch.float16) -> None:
        """Run the blocks in `dtype` (torch.float16 or torch.bfloat16; None: float32, the CPU
        default). Call after loading; F16 weights are viewed, not copied, for float16."""
        if dtype not in (None, torch.float16, torch.bfloat16):
            raise ValueError(f"use_half takes torch.float16, torch.bfloat16 or None, not {dtype}")
        for blk in self.blk:
            blk.use_half(dtype)

    def forward(self, pixels: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.patch_embd(pixels) + self.position_embd.weight[position_ids]
        for blk in self.blk:
            x = blk(x)
        return self.post_ln(x)
