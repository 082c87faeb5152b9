"""llama.cpp's activation formats for prompts and the int8 prompt GEMM's math in torch (the
reference of `kernels/cpu/i8_gemm.h`): each weight type multiplies activations quantized as
ggml's `vec_dot_type` of that type (ggml-cpu.c's type traits) - Q8_K for Q4_K / Q5_K / Q6_K /
IQ4_XS, Q8_0 for Q4_0 / Q5_0 / Q8_0 / IQ4_NL, Q8_1 for Q4_1 / Q5_1.
"""

import numpy as np
import torch

from localllm.kernels.quant.dequant import dequantize
from localllm.kernels.quant.types import QuantType

Q8_K_TYPES = frozenset(QuantType[n] for n in ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS"))
Q8_1_TYPES = frozenset({QuantType.Q4_1, QuantType.Q5_1})


def activation_format(qtype: QuantType) -> str:
    """The format ("Q8_K", "Q8_1" or "Q8_0") llama.cpp quantizes a prompt's activations to."""
    qtype = QuantType(qtype)
    return "Q8_K" if qtype in Q8_K_TYPES else "Q8_1" if qtype in Q8_1_TYPES else "Q8_0"


def _f16(x: torch.Tensor) -> torch.Tensor:
    return x.half().float()  # round to nearest even, as F16C


def quantize_q8_k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [t, k] -> int codes [t, k/256, 256] and float32 scales [t, k/256, 1] as ggml's
    quantize_row_q8_K_ref: iscale = -127 / (the first value of largest magnitude), codes
    round_even(iscale x x) (at most 127), scale 1 / iscale."""
    g = x.float().reshape(x.shape[0], -1, 256)
    first = g.abs().argmax(-1, keepdim=True)  # argmax answers the first of equal values
    mx = g.gather(-1, first)
    live = mx != 0
    iscale = torch.where(live, -127.0 / torch.where(live, mx, torch.ones_like(mx)), 0.0)
    q = torch.round(g * iscale).clamp(max=127)
    d = torch.where(live, 1.0 / torch.where(live, iscale, torch.ones_like(iscale)), 0.0)
    return q, d


def quantize_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [t, k] -> codes [t, k/32, 32], scales fp16(amax / 127) and Q8_1's s = fp16(d x the codes'
    sum) [t, k/32, 1], as ggml's x86 quantize_row_q8_0 / _q8_1 (float32 steps, round to even)."""
    g = x.float().reshape(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax != 0, 127.0 / torch.where(amax != 0, amax, torch.ones_like(amax)), 0.0)
    q = torch.round(g * inv).clamp(max=127)
    d = amax / 127.0
    return q, _f16(d), _f16(d * q.sum(-1, keepdim=True))


def _block_mins(raw: torch.Tensor, qtype: QuantType) -> torch.Tensor:
    """Q4_1 / Q5_1's per-block minimums (the fp16 at bytes 2..3) as float64 [rows, k/32]."""
    nbytes = 20 if QuantType(qtype) == QuantType.Q4_1 else 24
    blocks = raw.reshape(-1, nbytes).numpy()
    m = np.ascontiguousarray(blocks[:, 2:4]).view(np.float16).astype(np.float64)
    return torch.from_numpy(m.reshape(raw.shape[0], -1))


def gemm_i8_reference(x: torch.Tensor, parts: list[torch.Tensor], qtype: QuantType,
                      k: int) -> torch.Tensor:  # fmt: skip
    """The int8 prompt path's math in torch, float64 [t, n]: x [t, k] in `activation_format`'s
    codes and scales, times the gguf-dequantized parts; for Q8_1 the minimums' term takes the
    activations' s, as llama.cpp's Q4_1 / Q5_1 dots do, in place of d x the codes' sum."""
    qtype = QuantType(qtype)
    t = x.shape[0]
    w = torch.cat([dequantize(p, qtype).reshape(-1, k) for p in parts]).double()
    if activation_format(qtype) == "Q8_K":
        q, d = quantize_q8_k(x)
        return (q.double() * d.double()).reshape(t, k) @ w.T
    q, d, s = quantize_q8_0(x)
    y = (q.double() * d.double()).reshape(t, k) @ w.T
    if qtype in Q8_1_TYPES:  # m x (s - d x sum q) per block
        m = torch.cat([_block_mins(p.reshape(p.shape[0], -1), qtype) for p in parts])
        e = (s.double() - d.double() * q.double().sum(-1, keepdim=True)).reshape(t, -1)
        y = y + e @ m.T
    return y
