"""The `qwen2` GGUF architecture: Qwen2 / Qwen2.5 dense models.

Llama-shaped pre-norm decoder with three differences that llama.cpp's qwen2 graph encodes:
Q/K/V projections carry biases, rope is NEOX-style (rotate halves; the converter does not
permute Q/K), and the output head may carry a bias. Tied output embedding when `output.weight`
is absent.
"""

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from localllm.engine.batch import BatchMeta, KVCache
from localllm.engine.layers import GatedMLP, QuantEmbedding, QuantLinear, RMSNorm, attention
from localllm.engine.models.common import arch_key, rope_scale
from localllm.engine.rope import RopeConfig, Rotary


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

    def qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-head q [T, H, D], k and v [T, KV, D] before rope."""
        a = self.args
        q = self.attn_q(h).view(-1, a.n_heads, a.head_dim)
        k = self.attn_k(h).view(-1, a.n_kv_heads, a.head_dim)
        return q, k, self.attn_v(h).view(-1, a.n_kv_heads, a.head_dim)

    def forward(self, x, positions, cos_sin, rotary, batch, kv, layer):
        a = self.args
        h = self.attn_norm(x)
        q, k, v = self.qkv(h)
        q, k = rotary.apply(q, *cos_sin), rotary.apply(k, *cos_sin)
        o = attention(q, k, v, positions, batch, kv, layer, scale=a.head_dim**-0.5)
        x = x + self.attn_output(o.reshape(-1, a.n_heads * a.head_dim))
        return x + self.mlp(self.ffn_norm(x))


class Model(nn.Module):
    # GGUF names the MLP tensors at block level; our GatedMLP sits one module deeper.
    tensor_aliases: ClassVar[dict[str, str]] = {
        "ffn_gate": "mlp.ffn_gate",
        "ffn_up": "mlp.ffn_up",
        "ffn_down": "mlp.ffn_down",
    }
    optional_tensors = ("output.weight",)
    block_cls = Block  # qwen3 reuses this model with its own block

    def __init__(self, args: ModelArgs, precise: bool = False):
        super().__init__()
        self.args = args
        self.token_embd = QuantEmbedding(args.vocab_size, args.dim)
        self.blk = nn.ModuleList(self.block_cls(args, precise) for _ in range(args.n_layers))
        self.output_norm = RMSNorm(args.dim, args.norm_eps)
        self.output = QuantLinear(args.dim, args.vocab_size, precise)
        self.rotary = None

    def finish_load(self, extra: dict[str, torch.Tensor]) -> None:
        """Called by the loader after every tensor is in place."""
        if not self.output.loaded:  # tied embeddings (an `output.bias`, if any, stays)
            self.output.load_tensor("weight", self.token_embd.weight)
        a = self.args
        cfg = RopeConfig(a.head_dim, a.rope_base, neox=True, linear_scale=a.rope_linear_scale)
        self.rotary = Rotary(cfg)
        for blk in self.blk:
            blk.mlp.fuse()

    def kv_shape(self) -> tuple[int, int, int]:
        """(layers, kv heads, head dim) for the runner's cache allocation."""
        return self.args.n_layers, self.args.n_kv_heads, self.args.head_dim

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, batch: BatchMeta, kv: KVCache
    ) -> torch.Tensor:
        """Hidden states [T, dim] after the final norm."""
        x = self.token_embd(ids)
        cos_sin = self.rotary.cos_sin(positions)
        for i, blk in enumerate(self.blk):
            x = blk(x, positions, cos_sin, self.rotary, batch, kv, i)
        return self.output_norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.output(hidden)
