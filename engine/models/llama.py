"""The `llama` GGUF architecture: Llama 2/3, Mistral, SmolLM and their relatives.

Pre-norm decoder: RMSNorm -> GQA attention with NORM-style rope (the converter permutes Q/K for
it) -> residual; RMSNorm -> SwiGLU -> residual. Optional llama3 frequency factors (`rope_freqs`),
tied output embedding when `output.weight` is absent.
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
from localllm.engine.moe.block import MoEFeedForward
from localllm.engine.moe.expert_tensor import EXPERT_TENSORS


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
    rope_dims: int
    rope_linear_scale: float
    context_length: int
    n_expert: int = 0  # Mixtral-style MoE: experts in ffn_*_exps, router in ffn_gate_inp
    n_expert_used: int = 0

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], vocab_size: int) -> "ModelArgs":
        k = arch_key(meta)
        n_heads = k("attention.head_count")
        dim = k("embedding_length")
        head_dim = k("attention.key_length", dim // n_heads)
        return cls(
            arch=meta["general.architecture"],
            vocab_size=vocab_size,
            dim=dim,
            n_layers=k("block_count"),
            n_heads=n_heads,
            n_kv_heads=k("attention.head_count_kv", n_heads),
            head_dim=head_dim,
            hidden_dim=k("feed_forward_length"),
            norm_eps=k("attention.layer_norm_rms_epsilon", 1e-5),
            rope_base=k("rope.freq_base", 10000.0),
            rope_dims=k("rope.dimension_count", head_dim),
            rope_linear_scale=rope_scale(meta),
            context_length=k("context_length", 4096),
            n_expert=k("expert_count", 0),
            n_expert_used=k("expert_used_count", 0),
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
        if args.n_expert:  # the model numbers the MoE layers after construction
            self.mlp = MoEFeedForward(
                0, args.dim, args.hidden_dim, args.n_expert, args.n_expert_used, True
            )
            self.mlp.sum_in_norm = True  # its output is pending until the next norm adds it
        else:
            self.mlp = GatedMLP(args.dim, args.hidden_dim, "silu", precise)
        self.qkv: FusedLinear | None = None

    def fuse(self) -> None:
        parts = [self.attn_q, self.attn_k, self.attn_v]
        if FusedLinear.fusable(parts, mixed=True):
            self.qkv = FusedLinear(parts)
        self.mlp.fuse()

    def forward(self, x, r, positions, cos_sin, rotary, batch, kv, layer):
        """The stream is x + r (r: the previous block's pending output, or None); returns the
        new (x, r): the MLP's output is added by the next norm, in its kernel."""
        a = self.args
        if r is None:  # hq: h quantized for the dp4a GEMVs, or None
            h, hq = self.attn_norm.forward_q(x, feeds=self.qkv)
        else:  # (feeds: the norm's kernel may run q|k|v's LoRA shrink)
            x, h, hq = self.attn_norm.residual_q(x, r, feeds=self.qkv)
        nq, nkv, hd = a.n_heads, a.n_kv_heads, a.head_dim
        if self.qkv is not None:  # q, k, v side by side in one output: views, no copies
            q, k, v = self.qkv(h, hq)
        else:
            q, k, v = self.attn_q(h, hq), self.attn_k(h, hq), self.attn_v(h, hq)
        lay = rotary.layout(nq, nkv, hd)
        # oq: o quantized by the attention kernel for the output projection's GEMV, or None
        args = (q, k, v, lay, cos_sin, rotary, batch, kv, layer, hd**-0.5)
        o, oq = rope_attention_q(
            *args, quant=self.attn_output.takes_quantized, feeds=self.attn_output
        )
        o = self.attn_output(o.reshape(-1, nq * hd), oq)
        x, h, hq = self.ffn_norm.residual_q(x, o, feeds=getattr(self.mlp, "first", None))
        return x, self.mlp(h, hq)


class Model(Decoder):
    optional_tensors = ("rope_freqs.weight", "output.weight")
    tensor_aliases = {  # noqa: RUF012 (a class constant the loader reads)
        **Decoder.tensor_aliases,
        **{n: f"mlp.{n}" for n in ("ffn_gate_inp", *EXPERT_TENSORS)},
    }

    def __init__(self, args: ModelArgs, precise: bool = False):
        super().__init__(args, [Block(args, precise) for _ in range(args.n_layers)], precise)
        if args.n_expert:
            for i, blk in enumerate(self.blk):
                blk.mlp.layer = i

    def finish_load(self, extra: dict[str, torch.Tensor]) -> None:
        """Called by the loader after every tensor is in place."""
        self.tie_output()
        a = self.args
        cfg = RopeConfig(a.rope_dims, a.rope_base, neox=False, linear_scale=a.rope_linear_scale)
        self.rotary = Rotary(cfg, extra.get("rope_freqs.weight"))
        for blk in self.blk:
            blk.fuse()
