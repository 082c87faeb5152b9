"""The `olmo2` GGUF architecture: OLMo 2 (1B, 7B, 13B, 32B).

Follows llama.cpp's olmo2 graph: no norm before attention or the MLP; instead Q and K are each
RMS-normed over their whole projection (all heads at once, `attn_q_norm` [heads * head_dim],
`attn_k_norm` [kv heads * head_dim]) before NEOX rope, the attention output goes through
`post_attention_norm` before the residual add, and the SwiGLU output through `post_ffw_norm`.
Separate output head.

The same converter writes Olmo 3 as `olmo2` with sliding-window layers and YaRN on the global
ones; those files are refused with a clear error until that variant is implemented.
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
from localllm.engine.models.hparams import HyperparameterError


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
    sliding_window: int  # 0: none (OLMo 2); Olmo 3 files have one

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
            context_length=k("context_length", 4096),
            sliding_window=k("attention.sliding_window", 0),
        )

    def check(self) -> None:
        """Olmo 3's sliding-window layers are not implemented: refuse, never run them wrong."""
        if self.sliding_window:
            raise HyperparameterError(
                f"attention.sliding_window is {self.sliding_window}: this is an Olmo 3 file "
                "(sliding-window layers), which the olmo2 family does not run yet"
            )


class Block(nn.Module):
    def __init__(self, args: ModelArgs, precise: bool):
        super().__init__()
        hd, nq, nkv = args.head_dim, args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        self.args = args
        self.attn_q = QuantLinear(args.dim, nq, precise)
        self.attn_k = QuantLinear(args.dim, nkv, precise)
        self.attn_v = QuantLinear(args.dim, nkv, precise)
        self.attn_q_norm = RMSNorm(nq, args.norm_eps)
        self.attn_k_norm = RMSNorm(nkv, args.norm_eps)
        self.attn_output = QuantLinear(nq, args.dim, precise)
        self.post_attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = GatedMLP(args.dim, args.hidden_dim, "silu", precise)
        self.post_ffw_norm = RMSNorm(args.dim, args.norm_eps)
        self.qkv: FusedLinear | None = None
        self.hd = hd

    def fuse(self) -> None:
        parts = [self.attn_q, self.attn_k, self.attn_v]
        if FusedLinear.fusable(parts, mixed=True):
            self.qkv = FusedLinear(parts)
        self.mlp.fuse()

    def forward(self, x, positions, cos_sin, rotary, batch, kv, layer):
        a = self.args
        if self.qkv is not None:
            q, k, v = self.qkv(x)
        else:
            q, k, v = self.attn_q(x), self.attn_k(x), self.attn_v(x)
        q, k = self.attn_q_norm(q), self.attn_k_norm(k)  # over all heads, before rope
        lay = rotary.layout(a.n_heads, a.n_kv_heads, self.hd)
        args = (q, k, v, lay, cos_sin, rotary, batch, kv, layer, self.hd**-0.5)
        o, oq = rope_attention_q(*args, quant=self.attn_output.takes_quantized)
        o = self.attn_output(o.reshape(-1, a.n_heads * self.hd), oq)
        x = x + self.post_attention_norm(o)
        return x + self.post_ffw_norm(self.mlp(x))


class Model(Decoder):
    def __init__(self, args: ModelArgs, precise: bool = False):
        super().__init__(args, [Block(args, precise) for _ in range(args.n_layers)], precise)

    def finish_load(self, extra: dict[str, torch.Tensor]) -> None:
        """Called by the loader after every tensor is in place."""
        self.tie_output()
        a = self.args
        cfg = RopeConfig(a.head_dim, a.rope_base, neox=True, linear_scale=a.rope_linear_scale)
        self.rotary = Rotary(cfg)
        for blk in self.blk:
            blk.fuse()
