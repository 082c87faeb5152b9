"""The `phi3` GGUF architecture: Phi-3 / Phi-3.5 mini and medium, Phi-4.

Pre-norm decoder as llama.cpp's phi3 graph runs it: one fused `attn_qkv` projection split into
Q, K, V; NEOX rope over the first `rope.dimension_count` dims of each head (partial rotary);
a fused `ffn_up` holding [gate; up] for SwiGLU. LongRoPE models ship per-frequency divisors
(`rope_factors_long` / `rope_factors_short`) and an attention factor scaling cos/sin.
Sliding window: llama.cpp disables it for phi3 whatever the metadata says, and so do we.
"""

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from localllm.engine.layers.linear import QuantLinear
from localllm.engine.layers.rope import RopeConfig, Rotary
from localllm.engine.layers.shared import RMSNorm, attention
from localllm.engine.models.common import arch_key, rope_scale
from localllm.engine.models.decoder import Decoder

ROPE_LONG, ROPE_SHORT = "rope_factors_long.weight", "rope_factors_short.weight"


@dataclass(frozen=True)
class ModelArgs:
    arch: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    norm_eps: float
    rope_dims: int
    rope_base: float
    rope_linear_scale: float
    rope_attn_factor: float  # LongRoPE: sqrt(1 + ln(ctx / orig_ctx) / ln(orig_ctx)), else 1
    rope_orig_context: int  # LongRoPE switches to the long factors above this context
    context_length: int

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], vocab_size: int) -> "ModelArgs":
        k = arch_key(meta)
        n_heads = k("attention.head_count")
        dim = k("embedding_length")
        head_dim = k("attention.key_length", dim // n_heads)
        ctx = k("context_length", 4096)
        return cls(
            arch=meta["general.architecture"],
            vocab_size=vocab_size,
            dim=dim,
            n_layers=k("block_count"),
            n_heads=n_heads,
            n_kv_heads=k("attention.head_count_kv", n_heads),
            head_dim=head_dim,
            hidden_dim=k("feed_forward_length"),
            norm_eps=k("attention.layer_norm_rms_epsilon"),
            rope_dims=k("rope.dimension_count", head_dim),
            rope_base=k("rope.freq_base", 10000.0),
            rope_linear_scale=rope_scale(meta),
            rope_attn_factor=float(k("rope.scaling.attn_factor", 1.0)),
            rope_orig_context=k("rope.scaling.original_context_length", ctx),
            context_length=ctx,
        )


class Block(nn.Module):
    def __init__(self, args: ModelArgs, precise: bool):
        super().__init__()
        hd = args.head_dim
        self.args = args
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.attn_qkv = QuantLinear(args.dim, (args.n_heads + 2 * args.n_kv_heads) * hd, precise)
        self.attn_output = QuantLinear(args.n_heads * hd, args.dim, precise)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_up = QuantLinear(args.dim, 2 * args.hidden_dim, precise)  # rows: [gate; up]
        self.ffn_down = QuantLinear(args.hidden_dim, args.dim, precise)

    def forward(self, x, positions, cos_sin, rotary, batch, kv, layer):
        a = self.args
        nq, nkv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        q, k, v = self.attn_qkv(self.attn_norm(x)).split((nq, nkv, nkv), dim=-1)
        q = q.reshape(-1, a.n_heads, a.head_dim)
        k = k.reshape(-1, a.n_kv_heads, a.head_dim)
        v = v.reshape(-1, a.n_kv_heads, a.head_dim)
        q, k = rotary.apply(q, *cos_sin), rotary.apply(k, *cos_sin)
        o = attention(q, k, v, positions, batch, kv, layer, scale=a.head_dim**-0.5)
        x = x + self.attn_output(o.reshape(-1, nq))
        gate, up = self.ffn_up(self.ffn_norm(x)).chunk(2, dim=-1)
        return x + self.ffn_down(F.silu(gate) * up)


class Model(Decoder):
    tensor_aliases: ClassVar[dict[str, str]] = {}  # phi3's MLP tensors live on the block itself
    optional_tensors = ("output.weight", ROPE_LONG, ROPE_SHORT)

    def __init__(self, args: ModelArgs, precise: bool = False):
        super().__init__(args, [Block(args, precise) for _ in range(args.n_layers)], precise)

    def finish_load(self, extra: dict[str, torch.Tensor]) -> None:
        """Called by the loader after every tensor is in place."""
        self.tie_output()
        a = self.args
        # llama.cpp picks the long factors when the context exceeds the original one; with its
        # default context (the trained one) that is the model's context_length.
        name = ROPE_LONG if a.context_length > a.rope_orig_context else ROPE_SHORT
        factors = extra.get(name)
        if factors is not None and factors.numel() != a.rope_dims // 2:
            raise ValueError(f"{name}: expected {a.rope_dims // 2} factors, got {factors.numel()}")
        cfg = RopeConfig(
            a.rope_dims,
            a.rope_base,
            neox=True,
            linear_scale=a.rope_linear_scale,
            attn_factor=a.rope_attn_factor,
        )
        self.rotary = Rotary(cfg, factors)
