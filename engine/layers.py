"""Shared layers that model files compose: keep-quant linear/embedding, RMSNorm, attention, MLP.

Weights arrive as `QuantWeight`s and stay in their ggml encoding; every loadable module implements
`load_tensor(suffix, weight)` so that loading a GGUF is a walk over tensor names (see `loader`).
Per-architecture knowledge stays in the model files, never here.
"""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from localllm.engine.batch import BatchMeta
from localllm.engine.kv_cache import PagedKVCache
from localllm.engine.rope import Rotary
from localllm.kernels.fused import add_rms_norm, rms_norm, silu_mul
from localllm.kernels.fused.rope_qkv import HeadLayout, HeadNorms, fusable, rope_qkv_write
from localllm.kernels.quant.dequant import dequantize
from localllm.kernels.quant.linear import prepare_linear
from localllm.offload import QuantWeight


def dense(w: QuantWeight) -> torch.Tensor:
    """A small tensor (norm weights, biases) expanded to float32 in its logical shape."""
    return dequantize(w.data, w.qtype).reshape(w.shape)


def without_bytes(w: QuantWeight) -> QuantWeight:
    """`w` with a zero-storage stand-in of the same shape for its data: the metadata (type, shape,
    byte count, source range) stays for residency accounting; the bytes live in a kernel layout."""
    stub = torch.zeros(1, dtype=torch.uint8, device=w.data.device).expand(w.data.shape)
    return dataclasses.replace(w, data=stub)


class QuantLinear(nn.Module):
    """y = x @ W.T (+ b) with W kept as raw ggml blocks; the kernel dequantizes in the matmul."""

    def __init__(self, in_features: int, out_features: int, precise: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.precise = precise
        self.weight: QuantWeight | None = None
        self.bias: torch.Tensor | None = None
        self._prepared = None

    def load_tensor(self, suffix: str, w: QuantWeight) -> None:
        if suffix == "bias":
            self.bias = dense(w).reshape(self.out_features)
            return
        if suffix != "weight":
            raise KeyError(suffix)
        if tuple(w.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"expected shape {(self.out_features, self.in_features)}, got {tuple(w.shape)}"
            )
        self.weight = w
        self._prepared = prepare_linear(w.data, w.qtype, w.shape, precise=self.precise)

    @property
    def loaded(self) -> bool:
        return self.weight is not None

    def release_kernel(self) -> None:
        """Drop the prepared kernel weight once a FusedLinear computes this layer."""
        self._prepared = None

    def dense_weight(self) -> torch.Tensor | None:
        """The float32 W [N, K] the kernel multiplies by, when it keeps one (else None)."""
        w = getattr(self._prepared, "w", None)
        return w if isinstance(w, torch.Tensor) and w.dtype == torch.float32 else None

    def drop_raw_copy(self) -> None:
        """Free the raw device copy once the kernel holds the bytes in its own layout (call after
        fusing: FusedLinear stacks raw rows). The QuantWeight keeps its shape and byte count."""
        if getattr(self._prepared, "repacked", False) and self.weight.data.device.type != "cpu":
            self.weight = without_bytes(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._prepared.matmul(x.reshape(-1, self.in_features))
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y


class FusedLinear(nn.Module):
    """Several QuantLinears that read the same input, run as one matmul over stacked rows.

    The parts keep their QuantWeights (residency still sees every GGUF tensor); only the prepared
    kernel weight is shared, so decode makes one kernel call instead of three (q/k/v) or two
    (gate/up). Stacking raw ggml rows is exact: blocks never straddle rows.
    """

    def __init__(self, parts: list[QuantLinear]):
        super().__init__()
        w0 = parts[0].weight
        self.sizes = [p.out_features for p in parts]
        data = torch.cat([p.weight.data for p in parts])
        shape = (sum(self.sizes), parts[0].in_features)
        self._prepared = prepare_linear(data, w0.qtype, shape, precise=parts[0].precise)
        if getattr(self._prepared, "repacked", False) and data.device.type != "cpu":
            for p in parts:  # the kernel holds the only device copy, in its own layout
                p.weight = without_bytes(p.weight)
        elif data.device.type != "cpu":  # the parts view the stacked upload: one copy on the GPU
            for p, rows in zip(parts, data.split(self.sizes), strict=True):
                p.weight = dataclasses.replace(p.weight, data=rows)
        biases = [
            p.bias if p.bias is not None else torch.zeros(p.out_features, device=data.device)
            for p in parts
        ]
        has_bias = any(p.bias is not None for p in parts)
        self.bias = torch.cat(biases) if has_bias else None
        self.in_features = parts[0].in_features
        for p in parts:
            p.release_kernel()

    @staticmethod
    def fusable(parts: list[QuantLinear]) -> bool:
        """Same ggml type and input size (the stacked rows must form one valid tensor)."""
        w = [p.weight for p in parts]
        return all(x is not None and x.qtype == w[0].qtype for x in w) and all(
            p.in_features == parts[0].in_features for p in parts
        )

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The stacked outputs [T, sum(sizes)], parts side by side in the order given."""
        y = self._prepared.matmul(x.reshape(-1, self.in_features))
        return y + self.bias if self.bias is not None else y

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.project(x).split(self.sizes, dim=-1)


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
        return rms_norm(x, self.weight, self.eps)

    def residual(self, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + r, norm(x + r)) in one pass where a fused kernel exists."""
        return add_rms_norm(x, r, self.weight, self.eps)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None and self.act == "silu":
            return self.ffn_down(silu_mul(self.gate_up.project(x), self.hidden))
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
) -> torch.Tensor:
    """Causal GQA attention over the paged cache; q [T, H, D], k/v [T, KV, D] -> [T, H, Dv].

    Writes this step's k/v at the batch's slots first, then each sequence attends to its whole
    context (its new tokens are its last ones, so `positions` is implied by `batch.seq_lens`).
    `window` keeps only the last `window` keys (sliding window); `softcap` squashes scores with
    cap * tanh(s / cap); `sinks` [H] adds a per-head logit to each softmax's denominator.
    """
    kv.write(layer, k, v, batch.slot_mapping)
    if sinks is None:  # other caches (and their fast paths) need not know about sinks
        return kv.attend(layer, q, batch, scale, window, softcap)
    return kv.attend(layer, q, batch, scale, window, softcap, sinks)


def rope_attention(
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
) -> torch.Tensor:
    """A layer's attention from its projections: q [T, n_q * D], k and v [T, n_kv * D] (views of
    one fused projection are fine) -> [T, n_q, D]. Per-head norms (`norms`), rope and the KV write
    run as one kernel where the cache stores plain floats on CUDA, else step by step."""
    cache = kv.plain_layer(layer)
    if cache is not None and fusable(q, cache[0]):
        cos, sin = cos_sin
        q3 = rope_qkv_write(q, k, v, cos, sin, lay, *cache, batch.slot_mapping, norms)
        return kv.attend(layer, q3, batch, scale)
    hd = lay.head_dim
    q3, k3 = q.reshape(-1, lay.n_q, hd), k.reshape(-1, lay.n_kv, hd)
    if norms is not None:
        q3, k3 = rms_norm(q3, norms.q, norms.eps), rms_norm(k3, norms.k, norms.eps)
    q3, k3 = rotary.apply(q3, *cos_sin), rotary.apply(k3, *cos_sin)
    v3 = v.reshape(-1, lay.n_kv, hd)
    return attention(q3, k3, v3, None, batch, kv, layer, scale)
