"""`dequantize`: the torch reference for every ggml type gguf-py can decode, plus the float types.

Dispatches on QuantType to the per-family modules (dequant_legacy, dequant_k, dequant_iq,
dequant_ternary). Every result matches `gguf.quants.dequantize` bit for bit (tests/kernels).
Vectorised over blocks; works on any device the input lives on.
"""

from collections.abc import Callable
from types import MappingProxyType

import torch

from localllm.kernels.quant import dequant_iq as iq
from localllm.kernels.quant import dequant_k as k
from localllm.kernels.quant import dequant_legacy as legacy
from localllm.kernels.quant import dequant_ternary as ternary
from localllm.kernels.quant.blocks import to_blocks
from localllm.kernels.quant.types import QuantType, block_geometry


def _f32(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float32)


def _f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()


def _bf16(b: torch.Tensor) -> torch.Tensor:
    # bf16 is the top half of an f32: widen by shifting the bits, exact for NaN payloads too
    return (b.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)


_BLOCK_FNS: MappingProxyType[QuantType, Callable[[torch.Tensor], torch.Tensor]] = MappingProxyType(
    {
        QuantType.F32: _f32,
        QuantType.F16: _f16,
        QuantType.BF16: _bf16,
        QuantType.Q4_0: legacy.q4_0,
        QuantType.Q4_1: legacy.q4_1,
        QuantType.Q5_0: legacy.q5_0,
        QuantType.Q5_1: legacy.q5_1,
        QuantType.Q8_0: legacy.q8_0,
        QuantType.IQ4_NL: legacy.iq4_nl,
        QuantType.MXFP4: legacy.mxfp4,
        QuantType.NVFP4: legacy.nvfp4,
        QuantType.Q2_K: k.q2_k,
        QuantType.Q3_K: k.q3_k,
        QuantType.Q4_K: k.q4_k,
        QuantType.Q5_K: k.q5_k,
        QuantType.Q6_K: k.q6_k,
        QuantType.IQ2_XXS: iq.iq2_xxs,
        QuantType.IQ2_XS: iq.iq2_xs,
        QuantType.IQ2_S: iq.iq2_s,
        QuantType.IQ3_XXS: iq.iq3_xxs,
        QuantType.IQ3_S: iq.iq3_s,
        QuantType.IQ1_S: iq.iq1_s,
        QuantType.IQ1_M: iq.iq1_m,
        QuantType.IQ4_XS: iq.iq4_xs,
        QuantType.TQ1_0: ternary.tq1_0,
        QuantType.TQ2_0: ternary.tq2_0,
    }
)

DEQUANT_TYPES: frozenset[QuantType] = frozenset(_BLOCK_FNS)


class UnsupportedQuantError(ValueError):
    """A tensor uses a ggml type with no known decoding (e.g. Q8_1, Q8_K: llama.cpp-internal)."""


def dequantize(data: torch.Tensor, qtype: QuantType) -> torch.Tensor:
    """uint8 [..., row_bytes] in ggml encoding -> float32 [..., row_elements].

    For F32 input the result may share memory with `data`; otherwise it is a new tensor.
    """
    qtype = QuantType(qtype)
    fn = _BLOCK_FNS.get(qtype)
    if fn is None:
        raise UnsupportedQuantError(
            f"ggml type {qtype.name} has no dequantization (gguf-py cannot decode it either)"
        )
    block, nbytes = block_geometry(qtype)
    lead = tuple(data.shape[:-1])
    if data.dim() == 0:
        raise ValueError("quantized data needs at least one dimension (bytes)")
    n_elem = data.shape[-1] // nbytes * block
    blocks = to_blocks(data, nbytes)
    if blocks.shape[0] == 0:
        return torch.empty((*lead, n_elem), dtype=torch.float32, device=data.device)
    return fn(blocks).reshape(*lead, n_elem)
