"""The `gemma3` GGUF architecture: Gemma 3 text models (270M … 27B).

Follows llama.cpp's gemma3 graph: embeddings scaled by sqrt(dim); per block RMSNorm -> Q/K/V ->
per-head RMSNorm on Q and K -> NEOX rope -> attention -> post_attention_norm -> residual; then
RMSNorm -> GeGLU (tanh gelu) -> post_ffw_norm -> residual. Local layers attend to a sliding
window and use their own rope base; every `sliding_window_pattern`-th layer (default 6) is global.
Optional final logit soft-capping. The GGUF norm weights already include Gemma's +1.
Image embeddings (Gemma 3 vision) replace the scaled token embeddings of their soft tokens, and
the tokens of one image see each other both ways (window AND (causal OR same image)).
"""

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from localllm.engine.core.batch import BatchMeta
from localllm.engine.layers.linear import QuantLinear
from localllm.engine.layers.rope import RopeConfig, Rotary
from localllm.engine.layers.shared import GatedMLP, RMSNorm, attention
from localllm.engine.models.common import arch_key, rope_scale
from localllm.engine.models.decoder import Decoder
from localllm.engine.runtime.kv_cache import PagedKVCache

# llama.cpp: without `rope.freq_base_swa`, local layers keep the trained default of 10000.
LOCAL_ROPE_BASE = 10000.0
DEFAULT_SWA_PATTERN = 6
N_LAYERS_27B = 62  # llama.cpp's 27B type scales queries by (dim / heads)^-0.5, not head_dim^-0.5


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
    rope_base: float  # global layers
    rope_base_local: float  # sliding-window layers
    rope_linear_scale: float  # global layers only (local layers are never scaled)
    sliding_window: int  # 0: no sliding window, every layer global
    swa_layers: tuple[bool, ...]  # per layer: True = sliding-window (local) layer
    attn_scale: float
    final_softcap: float  # 0: none
    context_length: int

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], vocab_size: int) -> "ModelArgs":
        k = arch_key(meta)
        n_heads = k("attention.head_count")
        dim = k("embedding_length")
        n_layers = k("block_count")
        head_dim = k("attention.key_length", dim // n_heads)
        window = int(k("attention.sliding_window", 0))
        # llama.cpp reads the pattern only as a scalar; an array leaves the default.
        period = k("attention.sliding_window_pattern", DEFAULT_SWA_PATTERN)
        if not isinstance(period, int):
            period = DEFAULT_SWA_PATTERN
        # Layer il is local unless il % period == period - 1 (period 0: all local).
        swa = tuple(
            window > 0 and (period == 0 or i % period < period - 1) for i in range(n_layers)
        )
        scale_dim = dim // n_heads if n_layers == N_LAYERS_27B else head_dim
        return cls(
            arch=meta["general.architecture"],
            vocab_size=vocab_size,
            dim=dim,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=k("attention.head_count_kv", n_heads),
            head_dim=head_dim,
            hidden_dim=k("feed_forward_length"),
            norm_eps=k("attention.layer_norm_rms_epsilon"),
            rope_dims=k("rope.dimension_count", head_dim),
            rope_base=k("rope.freq_base", 10000.0),
            rope_base_local=k("rope.freq_base_swa", LOCAL_ROPE_BASE),
            rope_linear_scale=rope_scale(meta),
            sliding_window=window,
            swa_layers=swa,
            attn_scale=1.0 / math.sqrt(scale_dim),
            final_softcap=float(k("final_logit_softcapping", 0.0) or 0.0),
            context_length=k("context_length", 32768),
        )


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, precise: bool):
        super().__init__()
        hd = args.head_dim
        self.args = args
        self.local = args.swa_layers[layer]
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.attn_q = QuantLinear(args.dim, args.n_heads * hd, precise)
        self.attn_k = QuantLinear(args.dim, args.n_kv_heads * hd, precise)
        self.attn_v = QuantLinear(args.dim, args.n_kv_heads * hd, precise)
        self.attn_q_norm = RMSNorm(hd, args.norm_eps)
        self.attn_k_norm = RMSNorm(hd, args.norm_eps)
        self.attn_output = QuantLinear(args.n_heads * hd, args.dim, precise)
        self.post_attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = GatedMLP(args.dim, args.hidden_dim, "gelu", precise)
        self.post_ffw_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, positions, cos_sin, rotary, batch, kv, layer):
        a = self.args
        h = self.attn_norm(x)
        q = self.attn_q_norm(self.attn_q(h).view(-1, a.n_heads, a.head_dim))
        k = self.attn_k_norm(self.attn_k(h).view(-1, a.n_kv_heads, a.head_dim))
        v = self.attn_v(h).view(-1, a.n_kv_heads, a.head_dim)
        q, k = rotary.apply(q, *cos_sin), rotary.apply(k, *cos_sin)
        window = a.sliding_window if self.local else None
        o = attention(q, k, v, positions, batch, kv, layer, scale=a.attn_scale, window=window,
                      spans=batch.embed_runs())  # fmt: skip
        x = x + self.post_attention_norm(self.attn_output(o.reshape(-1, a.n_heads * a.head_dim)))
        return x + self.post_ffw_norm(self.mlp(self.ffn_norm(x)))


class Model(Decoder):
    # The tokens of one image attend to each other both ways at prefill (transformers' token
    # type mask): the scheduler keeps an image's tokens in one chunk (`embed_runs` spans).
    bidirectional_mm = True

    def __init__(self, args: ModelArgs, precise: bool = False):
        blocks = [Block(args, i, precise) for i in range(args.n_layers)]
        super().__init__(args, blocks, precise)
        self.embed_scale = math.sqrt(args.dim)
        self.rotary_global = self.rotary_local = None

    def finish_load(self, extra: dict[str, torch.Tensor]) -> None:
        """Called by the loader after every tensor is in place."""
        self.tie_output()  # every released Gemma 3 ties its output to the embedding
        a = self.args
        glob = RopeConfig(a.rope_dims, a.rope_base, neox=True, linear_scale=a.rope_linear_scale)
        self.rotary_global = Rotary(glob)
        self.rotary_local = Rotary(RopeConfig(a.rope_dims, a.rope_base_local, neox=True))
        for blk in self.blk:
            blk.mlp.fuse()  # gate and up share an encoding in real files: one matmul

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, batch: BatchMeta, kv: PagedKVCache
    ) -> torch.Tensor:
        """Hidden states [T, dim] after the final norm."""
        x = self.native_decode(ids, positions, batch, kv)  # CPU decode: one native call
        if x is not None:
            return self.output_norm(x)
        h = self.native_split(ids, positions, batch, kv)  # CPU decode rows beside prompts
        if h is not None:
            return h
        x = batch.splice(self.token_embd(ids) * self.embed_scale)  # images are not scaled
        rg, rl = self.rotary_global, self.rotary_local
        cs_global, cs_local = rg.cos_sin(positions), rl.cos_sin(positions)
        for i, blk in enumerate(self.blk):
            rotary, cos_sin = (rl, cs_local) if blk.local else (rg, cs_global)
            x = blk(x, positions, cos_sin, rotary, batch, kv, i)
        return self.output_norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.output(hidden)
        cap = self.args.final_softcap
        return cap * torch.tanh(out / cap) if cap else out
