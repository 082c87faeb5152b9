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
from localllm.kernels.fused import (
    QUANT_MAX_ROWS,
    add_rms_norm_q,
    rms_norm_q,
    silu_mul_q,
)
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

    def kernels(self) -> list:
        """The prepared kernel weights this module multiplies by (none once a FusedLinear does)."""
        return [self._prepared] if self._prepared is not None else []

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

    def forward(self, x: torch.Tensor, xq=None) -> torch.Tensor:
        """`xq`: x's rows already quantized by the kernel that made x (see `kernels.fused`)."""
        y = _matmul(self._prepared, x.reshape(-1, self.in_features), xq)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y


def _matmul(prepared, x: torch.Tensor, xq) -> torch.Tensor:
    # only the triton kernels take pre-quantized rows; the others ignore the twin
    if xq is not None and prepared.kind == "triton":
        return prepared.matmul(x, xq)
    return prepared.matmul(x)


class FusedLinear(nn.Module):
    """Several QuantLinears that read the same input, run as few matmuls over stacked rows.

    Consecutive parts of one ggml type share one kernel weight (q/k/v: one call instead of three;
    gate/up: one instead of two); parts of another type (Q4_K_M's Q6_K attn_v) get their own,
    and all share the input's quantization on CUDA. The parts keep their QuantWeights (residency
    still sees every GGUF tensor). Stacking raw ggml rows is exact: blocks never straddle rows.
    """

    def __init__(self, parts: list[QuantLinear]):
        super().__init__()
        self.sizes = [p.out_features for p in parts]
        self.in_features = parts[0].in_features
        self._groups: list[tuple[object, list[int]]] = []  # (kernel weight, part sizes)
        i = 0
        while i < len(parts):
            j = i + 1
            while j < len(parts) and parts[j].weight.qtype == parts[i].weight.qtype:
                j += 1
            self._groups.append((self._stack(parts[i:j]), self.sizes[i:j]))
            i = j
        device = parts[0].weight.data.device
        biases = [
            p.bias if p.bias is not None else torch.zeros(p.out_features, device=device)
            for p in parts
        ]
        has_bias = any(p.bias is not None for p in parts)
        self.bias = torch.cat(biases) if has_bias else None
        for p in parts:
            p.release_kernel()

    @staticmethod
    def _stack(parts: list[QuantLinear]):
        w0 = parts[0].weight
        data = torch.cat([p.weight.data for p in parts])
        shape = (sum(p.out_features for p in parts), parts[0].in_features)
        prepared = prepare_linear(data, w0.qtype, shape, precise=parts[0].precise)
        if getattr(prepared, "repacked", False) and data.device.type != "cpu":
            for p in parts:  # the kernel holds the only device copy, in its own layout
                p.weight = without_bytes(p.weight)
        elif data.device.type != "cpu":  # the parts view the stacked upload: one copy on the GPU
            for p, rows in zip(parts, data.split([p.out_features for p in parts]), strict=True):
                p.weight = dataclasses.replace(p.weight, data=rows)
        return prepared

    @staticmethod
    def fusable(parts: list[QuantLinear], mixed: bool = False) -> bool:
        """Loaded parts with one input size; of one ggml type unless `mixed` (then the types may
        differ: one kernel weight per run of equal types)."""
        w = [p.weight for p in parts]
        if not all(x is not None for x in w):
            return False
        same = mixed or all(x.qtype == w[0].qtype for x in w)
        return same and all(p.in_features == parts[0].in_features for p in parts)

    def kernels(self) -> list:
        return [k for k, _ in self._groups]

    def project(self, x: torch.Tensor, xq=None) -> torch.Tensor:
        """The stacked outputs [T, sum(sizes)], parts side by side in the order given (one kernel
        weight only: GatedMLP's gate/up)."""
        if len(self._groups) != 1:
            raise ValueError("project() needs parts of one ggml type; call the module instead")
        y = _matmul(self._groups[0][0], x.reshape(-1, self.in_features), xq)
        return y + self.bias if self.bias is not None else y

    def forward(self, x: torch.Tensor, xq=None) -> tuple[torch.Tensor, ...]:
        """Each part's output [T, size] (views of the group outputs)."""
        x2 = x.reshape(-1, self.in_features)
        packed = all(getattr(k, "repacked", False) for k, _ in self._groups)
        if xq is None and len(self._groups) > 1 and x2.is_cuda and packed:
            xq = _quantized_twin(x2)  # once for every group
        outs: list[torch.Tensor] = []
        for kernel, sizes in self._groups:
            outs.extend(_matmul(kernel, x2, xq).split(sizes, dim=-1))
        if self.bias is not None:
            outs = [o + b for o, b in zip(outs, self.bias.split(self.sizes), strict=True)]
        return tuple(outs)


def _quantized_twin(x: torch.Tensor):
    """x's rows quantized for the dp4a GEMVs when they will take them (else None)."""
    if x.shape[0] > QUANT_MAX_ROWS or x.dtype != torch.float32 or x.shape[1] % 32:
        return None
    from localllm.kernels.quant.triton_packed import quantize_x8

    return quantize_x8(x.contiguous())


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

    def forward_q(self, x: torch.Tensor):
        """(norm(x), its rows quantized for the next dp4a GEMV, or None where none applies)."""
        return rms_norm_q(x, self.weight, self.eps)

    def residual(self, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + r, norm(x + r)) in one pass where a fused kernel exists."""
        return add_rms_norm_q(x, r, self.weight, self.eps, quant=False)[:2]

    def residual_q(self, x: torch.Tensor, r: torch.Tensor):
        """(x + r, norm(x + r), the norm's quantized rows or None)."""
        return add_rms_norm_q(x, r, self.weight, self.eps)


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

    def forward(self, x: torch.Tensor, xq=None) -> torch.Tensor:
        """`xq`: x's quantized rows from the norm that made x (CUDA decode), or None."""
        if self.gate_up is not None and self.act == "silu":
            a, aq = silu_mul_q(self.gate_up.project(x, xq), self.hidden)
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
        q3 = rms_norm_q(q3, norms.q, norms.eps, quant=False)[0]
        k3 = rms_norm_q(k3, norms.k, norms.eps, quant=False)[0]
    q3, k3 = rotary.apply(q3, *cos_sin), rotary.apply(k3, *cos_sin)
    v3 = v.reshape(-1, lay.n_kv, hd)
    return attention(q3, k3, v3, None, batch, kv, layer, scale)
