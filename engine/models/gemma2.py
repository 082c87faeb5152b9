"""The `gemma2` GGUF architecture: Gemma 2 (2B, 9B, 27B).

Gemma 3's decoder without the per-head q/k norms, as llama.cpp's gemma2 graph runs it: embeddings
scaled by sqrt(dim); per block RMSNorm -> Q/K/V -> NEOX rope -> attention whose scores are
soft-capped (cap * tanh(s / cap), `attn_logit_softcapping`) -> post_attention_norm -> residual;
RMSNorm -> GeGLU (tanh gelu) -> post_ffw_norm -> residual; the final logits soft-capped too.
Layers alternate: even ones attend to a sliding window (`attention.sliding_window`, 4096 when
absent), odd ones globally (`sliding_window_pattern` 2). Queries are scaled by head_dim^-0.5,
except for the 27B (46 layers), scaled by (dim / heads)^-0.5 as llama.cpp does. The GGUF norm
weights already include Gemma's +1.
"""

import math
from dataclasses import dataclass
from typing import Any

from torch import nn

from localllm.engine.layers.linear import QuantLinear
from localllm.engine.layers.shared import GatedMLP, RMSNorm, attention
from localllm.engine.models import gemma3
from localllm.engine.models.common import arch_key, rope_scale
from localllm.engine.models.decoder import Decoder

DEFAULT_WINDOW = 4096  # llama.cpp's default when the file has no sliding_window
DEFAULT_SWA_PATTERN = 2
N_LAYERS_27B = 46


@dataclass(frozen=True)
class ModelArgs(gemma3.ModelArgs):
    attn_softcap: float  # 0: none

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], vocab_size: int) -> "ModelArgs":
        k = arch_key(meta)
        n_heads = k("attention.head_count")
        dim = k("embedding_length")
        n_layers = k("block_count")
        head_dim = k("attention.key_length", dim // n_heads)
        window = k("attention.sliding_window", DEFAULT_WINDOW)
        period = k("attention.sliding_window_pattern", DEFAULT_SWA_PATTERN)
        if not isinstance(period, int):  # llama.cpp reads a scalar here; an array: the default
            period = DEFAULT_SWA_PATTERN
        swa = tuple(
            window > 0 and (period == 0 or i % period < period - 1) for i in range(n_layers)
        )
        base = k("rope.freq_base", 10000.0)
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
            rope_base=base,
            rope_base_local=k("rope.freq_base_swa", base),  # gemma2: the global base
            rope_linear_scale=rope_scale(meta),
            sliding_window=window,
            swa_layers=swa,
            attn_scale=1.0 / math.sqrt(scale_dim),
            final_softcap=float(k("final_logit_softcapping", 0.0)),
            context_length=k("context_length", 8192),
            attn_softcap=float(k("attn_logit_softcapping", 0.0)),
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
        self.attn_output = QuantLinear(args.n_heads * hd, args.dim, precise)
        self.post_attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = GatedMLP(args.dim, args.hidden_dim, "gelu", precise)
        self.post_ffw_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, positions, cos_sin, rotary, batch, kv, layer):
        a = self.args
        h = self.attn_norm(x)
        q = self.attn_q(h).view(-1, a.n_heads, a.head_dim)
        k = self.attn_k(h).view(-1, a.n_kv_heads, a.head_dim)
        v = self.attn_v(h).view(-1, a.n_kv_heads, a.head_dim)
        q, k = rotary.apply(q, *cos_sin), rotary.apply(k, *cos_sin)
        window = a.sliding_window if self.local else None
        o = attention(q, k, v, positions, batch, kv, layer, a.attn_scale, window,
                      a.attn_softcap or None)  # fmt: skip
        x = x + self.post_attention_norm(self.attn_output(o.reshape(-1, a.n_heads * a.head_dim)))
        return x + self.post_ffw_norm(self.mlp(self.ffn_norm(x)))


class Model(gemma3.Model):
    """Gemma 3's model (scaled embeddings, local and global rope, capped logits) over Gemma 2's
    blocks."""

    def __init__(self, args: ModelArgs, precise: bool = False):
        blocks = [Block(args, i, precise) for i in range(args.n_layers)]
        Decoder.__init__(self, args, blocks, precise)
        self.embed_scale = math.sqrt(args.dim)
        self.rotary_global = self.rotary_local = None
