"""The exact affine form of the integer-code ggml types: w = a * code + b per 32-value group.

Q4_0, Q4_1, Q4_K (4-bit codes), Q5_0, Q5_1, Q5_K (5-bit) and Q8_0 (8-bit, stored as q + 128)
all decode as an unsigned integer code times a per-32 scale `a` plus a per-32 offset `b`. Every
a * code is exact in float32 (at most 22 significant bits), so fl(a * code + b) equals gguf-py's
dequant bit for bit, which is what lets the int4pack repack keep an exact fp32 path.
"""

from types import MappingProxyType

import torch

from localllm.kernels.quant import dequant_k as k
from localllm.kernels.quant.blocks import f16, i8, nibbles
from localllm.kernels.quant.dequant_legacy import five_bit_codes
from localllm.kernels.quant.types import QuantType, block_geometry

# code bits per type: 4-bit codes fit one int4 plane, wider codes are split into two
CODE_BITS: MappingProxyType[QuantType, int] = MappingProxyType(
    {
        QuantType.Q4_0: 4,
        QuantType.Q4_1: 4,
        QuantType.Q4_K: 4,
        QuantType.Q5_0: 5,
        QuantType.Q5_1: 5,
        QuantType.Q5_K: 5,
        QuantType.Q8_0: 8,
    }
)


def _legacy(b: torch.Tensor, qtype: QuantType):
    d = f16(b, 0)
    if qtype == QuantType.Q4_0:
        return nibbles(b[:, 2:18]), d, -8 * d
    if qtype == QuantType.Q4_1:
        return nibbles(b[:, 4:20]), d, f16(b, 2)
    if qtype == QuantType.Q5_0:
        return five_bit_codes(b, 2, 6), d, -16 * d
    if qtype == QuantType.Q5_1:
        return five_bit_codes(b, 4, 8), d, f16(b, 2)
    # Q8_0: signed q -> unsigned q + 128, so b = -128 d
    return (i8(b, 2, 32).to(torch.int16) + 128), d, -128 * d


def affine_codes(
    data: torch.Tensor, qtype: QuantType
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8 rows [N, row_bytes] -> codes uint8 [N, K], a and b float32 [N, K/32]."""
    qtype = QuantType(qtype)
    if qtype not in CODE_BITS:
        raise ValueError(f"{qtype.name} has no affine integer-code form")
    nbytes = block_geometry(qtype)[1]
    n_rows = data.shape[0]
    b = data.reshape(-1, nbytes)
    if qtype in (QuantType.Q4_K, QuantType.Q5_K):
        codes = k.q4_k_codes(b) if qtype == QuantType.Q4_K else k.q5_k_codes(b)
        a, dm = k.k_scales(b)
        off = -dm
    else:
        codes, a, off = _legacy(b, qtype)
    codes = codes.to(torch.uint8).reshape(n_rows, -1)
    return codes, a.reshape(n_rows, -1), off.reshape(n_rows, -1)
