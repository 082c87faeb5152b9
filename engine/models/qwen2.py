"""The `qwen2` GGUF architecture: Qwen2 / Qwen2.5 dense models.

Llama-shaped pre-norm decoder with three differences that llama.cpp's qwen2 graph encodes:
Q/K/V projections carry biases, rope is NEOX-style (rotate halves; the converter does not
permute Q/K), and the output head may carry a bias. Tied output embedding when `output.weight`
is absent.
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from localllm.engine.layers.linear import FusedLinear, QuantLinear
from localllm.engine.layers.rope import RopeConfig, Rotary
from localllm.engine.layers.shared import GatedMLP, RMSNorm, rope_attention_q
from localllm.engine.models.common import arch_key, rope_scale
from localllm.engine.models.decoder import Decoder
from localllm.kernels.fused import QUANT_MAX_ROWS
from localllm.kernels.fused.heads import HeadNorms


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
    rope_base: float
    rope_linear_scale: float
    context_length: int

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], vocab_size: int) -> "ModelArgs":
        k = arch_key(meta)
        n_heads = k("attention.head_count")
        dim = k("embedding_length")
        return cls(
            arch=meta["general.architecture"],
            vocab_size=vocab_size,
            dim=dim,
            n_layers=k("block_count"),
            n_heads=n_heads,
            n_kv_heads=k("attention.head_count_kv", n_heads),
            head_dim=k("attention.key_length", dim // n_heads),
            hidden_dim=k("feed_forward_length"),
            norm_eps=k("attention.layer_norm_rms_epsilon"),
            rope_base=k("rope.freq_base", 10000.0),
            rope_linear_scale=rope_scale(meta),
            context_length=k("context_length", 32768),
        )


class Block(nn.Module):
    defers_residual = True  # forward takes and returns (stream, pending output): `Decoder`

    def __init__(self, args: ModelArgs, precise: bool):
        super().__init__()
        hd = args.head_dim
        self.args = args
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.attn_q = QuantLinear(args.dim, args.n_heads * hd, precise)
        self.attn_k = QuantLinear(args.dim, args.n_kv_heads * hd, precise)
        self.attn_v = QuantLinear(args.dim, args.n_kv_heads * hd, precise)
        self.attn_output = QuantLinear(args.n_heads * hd, args.dim, precise)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = GatedMLP(args.dim, args.hidden_dim, "silu", precise)
        self.qkv_fused: FusedLinear | None = None

    def fuse(self) -> None:
        parts = [self.attn_q, self.attn_k, self.attn_v]
        if FusedLinear.fusable(parts, mixed=True):
            self.qkv_fused = FusedLinear(parts)
        self.mlp.fuse()

    def qkv(self, h: torch.Tensor, hq=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H * D], k and v [T, KV * D] before rope (views of one matmul when fused); `hq`:
        h's rows quantized by the norm, or None."""
        if self.qkv_fused is not None:
            return self.qkv_fused(h, hq)
        return self.attn_q(h, hq), self.attn_k(h, hq), self.attn_v(h, hq)

    def head_norms(self) -> HeadNorms | None:
        """Per-head q/k norms applied before rope (qwen3 has them)."""
        return None

    def forward(self, x, r, positions, cos_sin, rotary, batch, kv, layer):
        """The stream is x + r (r: the previous block's pending output, or None); returns the
        new (x, r): the MLP's output is added by the next norm, in its kernel."""
        a = self.args
        if r is None:  # (feeds: the norm's kernel may run q|k|v's LoRA shrink)
            h, hq = self.attn_norm.forward_q(x, feeds=self.qkv_fused)
        else:
            x, h, hq = self.attn_norm.residual_q(x, r, feeds=self.qkv_fused)
        q, k, v = self.qkv(h, hq)
        lay = rotary.layout(a.n_heads, a.n_kv_heads, a.head_dim)
        norms = self.head_norms()
        args = (q, k, v, lay, cos_sin, rotary, batch, kv, layer, a.head_dim**-0.5, norms)
        # oq: o quantized by the attention kernel for the output projection's GEMV, or None
        o, oq = rope_attention_q(
            *args, quant=self.attn_output.takes_quantized, feeds=self.attn_output
        )
        o = self.attn_output(o.reshape(-1, a.n_heads * a.head_dim), oq)
        # MoE experts packed on a GPU read a prompt's rows quantized too: the norm writes them
        rows = getattr(self.mlp, "quant_rows", QUANT_MAX_ROWS)
        x, h, hq = self.ffn_norm.residual_q(x, o, rows, feeds=getattr(self.mlp, "first", None))
        return x, self.mlp(h, hq)


class Model(Decoder):
    block_cls = Block  # qwen3 reuses this model with its own block

    def __init__(self, args: ModelArgs, precise: bool = False):
        blocks = [self.block_cls(args, precise) for _ in range(args.n_layers)]
        super().__init__(args, blocks, precise)

    def finish_load(self, extra: dict[str, torch.Tensor]) -> None:
        """Called by the loader after every tensor is in place."""
        self.tie_output()  # an `output.bias`, if any, stays
        a = self.args
        cfg = RopeConfig(a.head_dim, a.rope_base, neox=True, linear_scale=a.rope_linear_scale)
        self.rotary = Rotary(cfg)
        for blk in self.blk:
            blk.fuse()
