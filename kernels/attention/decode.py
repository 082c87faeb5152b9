"""Batched decode attention: all single-token sequences of a step in one padded gather.

Decode on CPU is bound by per-op overhead: looping over 16 sequences costs ~7 small ops each per
layer. Here the keys of every decoding sequence are gathered by slot into one padded tensor
[nd, m, KV, D] (padding masked to -inf) and two batched matmuls do the rest. The slot plan depends
only on the step's layout and the window, so callers build it once per step and reuse it for
every layer.
"""

from typing import TYPE_CHECKING

import torch

from localllm.kernels.attention.decode_plan import DecodePlan
from localllm.kernels.attention.kv_quant import decode_kv
from localllm.kernels.fused import QUANT_MAX_ROWS

if TYPE_CHECKING:  # triton is imported only where CUDA (or the interpreter) runs it
    from localllm.kernels.quant.triton_packed import QuantizedX


def _take(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    flat = cache.flatten(0, 1)
    if flat.dtype == torch.float8_e4m3fn:  # no float8 index kernel on CPU: move bytes
        return flat.view(torch.uint8)[slots].view(torch.float8_e4m3fn)
    return flat[slots]


def _flash(q: torch.Tensor, k_cache: torch.Tensor, k_scales, sinks) -> bool:
    """Whether the flash-decoding kernel (`triton_decode`) serves the call."""
    if not (q.is_cuda and q.dtype == torch.float32 and k_scales is None and sinks is None):
        return False
    from localllm.kernels.attention.triton_decode import supports

    return supports(k_cache, k_scales, sinks)


def quantized_output(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    k_scales: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> "QuantizedX | None":
    """Buffers (`triton_packed.QuantizedX`, [T, H * Dv]) for the output rows quantized for the
    dp4a GEMV that reads them next, which the flash kernel's combine fills along with the float
    rows (`decode_attention`'s `quant`): where that kernel runs, every row of q is one of the
    plan's, the GEMV takes that many rows quantized and Dv splits into 32-value groups (else
    None; also with `triton_decode.COMBINE_QUANT` off)."""
    t, h = q.shape[:2]
    dv = v_cache.shape[-1]
    if plan.slots.shape[0] != t or t > QUANT_MAX_ROWS or dv % 32:
        return None
    if not _flash(q, k_cache, k_scales, sinks):
        return None
    from localllm.kernels.attention import triton_decode
    from localllm.kernels.quant.triton_packed import empty_quantized

    return empty_quantized(t, h * dv, q.device) if triton_decode.COMBINE_QUANT else None


def serves_every_row(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    plan: DecodePlan | None,
    k_scales: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> bool:
    """Whether the flash-decoding kernel computes every row of q (all of them the plan's): only
    then can its combine write a product of the output, such as the next linear's LoRA shrink
    (`decode_attention`'s `shrink`)."""
    return (
        plan is not None
        and plan.slots.shape[0] == q.shape[0]
        and _flash(q, k_cache, k_scales, sinks)
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
    softcap: float | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    quant: "QuantizedX | None" = None,
    shrink=None,
) -> torch.Tensor:
    """Attention of the plan's query rows of q [T, H, D] -> [nd, H, Dv]; `sinks` [H] as in
    `paged_attention`. On CUDA, unquantized caches take the flash-decoding kernel, which writes
    the rows of `out` [T, H, Dv] directly when given (and returns `out`), and with `quant` (from
    `quantized_output` for the same arguments) those rows quantized too; with `shrink` (a
    `lora_delta.LoraShrink`, where `serves_every_row`) the output projection's LoRA shrink."""
    if _flash(q, k_cache, k_scales, sinks):
        from localllm.kernels.attention.triton_decode import flash_decode

        return flash_decode(q, k_cache, v_cache, plan, scale, softcap, out, quant=quant,
                            shrink=shrink)  # fmt: skip
    if quant is not None or shrink is not None:
        raise ValueError("quant and shrink are written by the flash-decoding kernel, not here")
    keys = decode_kv(
        _take(k_cache, plan.slots),
        _take(k_scales, plan.slots) if k_scales is not None else None,
        q.dtype,
    )  # [nd, m, KV, D]
    vals = decode_kv(
        _take(v_cache, plan.slots),
        _take(v_scales, plan.slots) if v_scales is not None else None,
        q.dtype,
    )
    nd, _, kvh, d = keys.shape
    qg = q[plan.rows].view(nd, kvh, -1, d)  # [nd, KV, G, D]
    scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)) * scale  # [nd, KV, G, m]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if plan.pad is not None:
        scores = scores.masked_fill(plan.pad, -torch.inf)
    if sinks is None:
        probs = scores.softmax(-1)
    else:  # an extra logit per head in the denominator only (gpt-oss attention sinks)
        total = torch.logaddexp(scores.logsumexp(-1, keepdim=True), sinks.view(1, kvh, -1, 1))
        probs = torch.exp(scores - total)
    out = torch.matmul(probs, vals.permute(0, 2, 1, 3))  # [nd, KV, G, Dv]
    return out.reshape(nd, q.shape[1], -1)
