"""Shared layers that model files compose: quantized embedding, RMSNorm, attention, MLP (the
keep-quant linear layers are `engine.layers.linear`'s).

Weights arrive as `QuantWeight`s and stay in their ggml encoding; every loadable module implements
`load_tensor(suffix, weight)` so that loading a GGUF is a walk over tensor names (see `loader`).
Per-architecture knowledge stays in the model files, never here.
"""

import torch
import torch.nn.functional as F
from torch import nn

from localllm.engine.core.batch import BatchMeta
from localllm.engine.layers.linear import FusedLinear, QuantLinear, dense
from localllm.engine.layers.rope import Rotary
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.kernels.fused import QUANT_MAX_ROWS, add_rms_norm_q, rms_norm_q, silu_mul_q
from localllm.kernels.fused.heads import HeadLayout, HeadNorms
from localllm.kernels.fused.rope_qkv import fusable, rope_qkv_write
from localllm.kernels.quant.dequant import dequantize
from localllm.offload import QuantWeight


class QuantEmbedding(nn.Module):
    """Token embedding table kept quantized: only the looked-up rows are dequantized."""

    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.num_embeddings, self.dim = num_embeddings, dim
        self.weight: QuantWeight | None = None

    def load_tensor(self, suffix: str, w: QuantWeight) -> None:
        if suffix != "weight" or tuple(w.shape) != (self.num_embeddings, self.dim):
            raise ValueError(f"expected weight {(self.num_embeddings, self.dim)}, got {w.shape}")
        self.weight = w

    @property
    def loaded(self) -> bool:
        return self.weight is not None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize(self.weight.data[ids], self.weight.qtype)


class DenseParam(nn.Module):
    """A small tensor read in float32 in its logical shape (routing biases, attention sinks, MLA's
    per-head k_b/v_b), whichever suffix the GGUF gives it."""

    def __init__(self, *shape: int):
        super().__init__()
        self.shape = shape
        self.value: torch.Tensor | None = None

    def load_tensor(self, suffix: str, w: QuantWeight) -> None:
        if tuple(w.shape) != self.shape:
            raise ValueError(f"expected {suffix} of shape {self.shape}, got {tuple(w.shape)}")
        self.value = dense(w)

    @property
    def loaded(self) -> bool:
        return self.value is not None


class RMSNorm(nn.Module):
    """x / rms(x) * w over the last dim (GGUF files already fold gemma's +1 into w)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = torch.ones(dim)
        self.loaded = False

    def load_tensor(self, suffix: str, w: QuantWeight) -> None:
        if suffix != "weight" or w.shape[-1] != self.weight.shape[0]:
            raise ValueError(f"expected norm weight of {self.weight.shape[0]}, got {w.shape}")
        self.weight = dense(w)
        self.loaded = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op instead of five: decode is dominated by per-op overhead (CPU and GPU).
        return rms_norm_q(x, self.weight, self.eps, quant=False)[0]

    def forward_q(self, x: torch.Tensor, feeds=None):
        """(norm(x), its rows quantized for the next dp4a GEMV, or None where none applies);
        `feeds`: the linear that reads it next, whose LoRA shrink the norm's kernel may run."""
        return rms_norm_q(x, self.weight, self.eps, shrink=_shrink_for(feeds, x))

    def residual(
        self, x: torch.Tensor, r: torch.Tensor, scale: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + scale * r, its norm) in one pass where a fused kernel exists."""
        return add_rms_norm_q(x, r, self.weight, self.eps, quant=False, scale=scale)[:2]

    def residual_q(
        self, x: torch.Tensor, r: torch.Tensor, max_rows: int = QUANT_MAX_ROWS, feeds=None,
        scale: float = 1.0,
    ):  # fmt: skip
        """(x + scale * r, its norm, the norm's quantized rows or None); `max_rows`: the most
        rows the reader takes quantized; `feeds`: as `forward_q`'s."""
        shrink = _shrink_for(feeds, x)
        return add_rms_norm_q(x, r, self.weight, self.eps, max_rows=max_rows, shrink=shrink,
                              scale=scale)  # fmt: skip


def _shrink_for(feeds, x: torch.Tensor):
    """The LoRA shrink of `feeds` (the linear that reads what the kernel at hand makes from x,
    or None) for that kernel to run, where `feeds` has adapters and hands it over."""
    lora = getattr(feeds, "lora", None)
    return None if lora is None else lora.producer_shrink(x.numel() // x.shape[-1], x.device)


class GatedMLP(nn.Module):
    """ffn_down(act(ffn_gate(x)) * ffn_up(x)): SwiGLU with silu, GeGLU with tanh-gelu."""

    def __init__(self, dim: int, hidden: int, act: str = "silu", precise: bool = False):
        super().__init__()
        self.ffn_gate = QuantLinear(dim, hidden, precise)
        self.ffn_up = QuantLinear(dim, hidden, precise)
        self.ffn_down = QuantLinear(hidden, dim, precise)
        self.act = act
        self.hidden = hidden
        self.gate_up: FusedLinear | None = None

    def fuse(self) -> None:
        """Run gate and up as one matmul when their encodings allow (call after loading)."""
        parts = [self.ffn_gate, self.ffn_up]
        if FusedLinear.fusable(parts):
            self.gate_up = FusedLinear(parts)

    @property
    def first(self) -> FusedLinear | None:
        """The one linear that reads this MLP's input (gate | up fused, SiLU), else None: what
        the norm before it `feeds`."""
        return self.gate_up if self.act == "silu" else None

    def forward(self, x: torch.Tensor, xq=None) -> torch.Tensor:
        """`xq`: x's quantized rows from the norm that made x (CUDA decode), or None."""
        if self.gate_up is not None and self.act == "silu":
            gu = self.gate_up.project(x, xq)
            a, aq = silu_mul_q(gu, self.hidden, shrink=_shrink_for(self.ffn_down, gu))
            return self.ffn_down(a, aq)
        if self.gate_up is not None:
            g, u = self.gate_up(x)
        else:
            g, u = self.ffn_gate(x), self.ffn_up(x)
        g = F.silu(g) if self.act == "silu" else F.gelu(g, approximate="tanh")
        return self.ffn_down(g * u)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    batch: BatchMeta,
    kv: PagedKVCache,
    layer: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    spans=None,
) -> torch.Tensor:
    """Causal GQA attention over the paged cache; q [T, H, D], k/v [T, KV, D] -> [T, H, Dv].

    Writes this step's k/v at the batch's slots first, then each sequence attends to its whole
    context (its new tokens are its last ones, so `positions` is implied by `batch.seq_lens`).
    `window` keeps only the last `window` keys (sliding window); `softcap` squashes scores with
    cap * tanh(s / cap); `sinks` [H] adds a per-head logit to each softmax's denominator;
    `spans` (per sequence, position ranges [a, b)) lets a query in a range see all of it.
    """
    kv.write(layer, k, v, batch.slot_mapping)
    if spans:
        return kv.attend(layer, q, batch, scale, window, softcap, sinks, spans)
    if sinks is None:  # other caches (and their fast paths) need not know about sinks
        return kv.attend(layer, q, batch, scale, window, softcap)
    return kv.attend(layer, q, batch, scale, window, softcap, sinks)


def rope_attention_q(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lay: HeadLayout,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    rotary: Rotary,
    batch: BatchMeta,
    kv: PagedKVCache,
    layer: int,
    scale: float,
    norms: HeadNorms | None = None,
    quant: bool = True,
    feeds=None,
):
    """A layer's attention from its projections: q [T, n_q * D], k and v [T, n_kv * D] (views of
    one fused projection are fine) -> ([T, n_q, D], its rows [T, n_q * D] quantized for the dp4a
    GEMV that reads them next, or None). Per-head norms (`norms`), rope and the KV write run as
    one kernel where the cache stores plain floats on CUDA, else step by step; the quantized rows
    come from the flash-decoding kernel on CUDA decode steps of few rows (pass `quant` only where
    the reader takes them: `QuantLinear.takes_quantized`). `feeds`: the output projection, whose
    LoRA shrink the attention's kernels may run (`RMSNorm.forward_q`'s)."""
    cache = kv.plain_layer(layer)
    if cache is not None and fusable(q, cache[0]):
        cos, sin = cos_sin
        q3 = rope_qkv_write(q, k, v, cos, sin, lay, *cache, batch.slot_mapping, norms)
        return kv.attend_q(layer, q3, batch, scale, quant=quant, shrink=_shrink_for(feeds, q))
    hd = lay.head_dim
    q3, k3 = q.reshape(-1, lay.n_q, hd), k.reshape(-1, lay.n_kv, hd)
    if norms is not None:
        q3 = rms_norm_q(q3, norms.q, norms.eps, quant=False)[0]
        k3 = rms_norm_q(k3, norms.k, norms.eps, quant=False)[0]
    q3, k3 = rotary.apply(q3, *cos_sin), rotary.apply(k3, *cos_sin)
    v3 = v.reshape(-1, lay.n_kv, hd)
    return attention(q3, k3, v3, None, batch, kv, layer, scale), None
