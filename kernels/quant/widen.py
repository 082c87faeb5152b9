"""32-value blocks rewritten as Q8_0 blocks, exactly: Q4_0, Q5_0 and IQ4_NL codes all fit int8.

llama.cpp's quantizer gives rows that are no whole number of 256-value K blocks a 32-value type
instead (Q4_K -> Q5_0, IQ4_XS / Q2_K / Q3_K -> IQ4_NL; Q6_K -> Q8_0 needs nothing): GLM-4.5-Air's
1408-wide experts make every `ffn_down_exps` of a Q4_K_M file Q5_0 or Q8_0. The GPU's packed dp4a
kernels take Q8_0; a block of one of these types keeps its fp16 scale and its 32 values become
the signed codes they dequantize to (Q4_0: q - 8, Q5_0: q - 16, IQ4_NL: its table), so the
Q8_0 block dequantizes to the same floats (d * code, one float32 product either way). The cost
is bytes: 34 per block instead of 18 / 22 (the bandwidth of that tensor grows 1.9x / 1.5x).
With NATIVE_Q5_0, Q5_0 blocks (experts' and dense linears') are packed as they are (`repack`'s
Q5_0 planes, 22 bytes a block) and the kernels build the same int8 words in registers
(`triton_dp4a._q8_words`).
"""

import torch

from localllm.kernels.quant.dequant_legacy import IQ4_NL_VALUES
from localllm.kernels.quant.types import QuantType, block_geometry

# Experts' Q5_0 blocks packed natively instead of widened (the packed GEMVs, grouped GEMMs and
# dequant read 22 bytes a block, not 34: GLM-4.5-Air Q4_K_M's expert bytes fall 9.1 %). Written
# and tested under the interpreter (bit-equal to the widened path), not yet run on a GPU: off
# until measured. Dense Q5_0 linears (`linear.TRITON_WIDENED`) then pack as stored too.
NATIVE_Q5_0 = False

WIDENED: dict[QuantType, QuantType] = {
    QuantType.Q4_0: QuantType.Q8_0,
    QuantType.Q5_0: QuantType.Q8_0,
    QuantType.IQ4_NL: QuantType.Q8_0,
}


def widened_type(qtype: QuantType) -> QuantType:
    """The type packed experts of `qtype` take: the one `widen_blocks` turns it into, or itself
    (not widened, or Q5_0 with NATIVE_Q5_0)."""
    qtype = QuantType(qtype)
    if qtype == QuantType.Q5_0 and NATIVE_Q5_0:
        return qtype
    return WIDENED.get(qtype, qtype)


def widened_nbytes(qtype: QuantType, nbytes: int) -> int:
    """Bytes of `nbytes` of `qtype` blocks as packed experts (`widened_type`)."""
    src = block_geometry(qtype)[1]
    return nbytes // src * block_geometry(widened_type(qtype))[1]


def _codes(b: torch.Tensor, qtype: QuantType) -> torch.Tensor:
    """Blocks uint8 [n, bytes] -> the signed codes int8 [n, 32] in element order."""
    qs = b[:, -16:]  # every type here ends with 16 bytes of low nibbles (elements 0-15) | highs
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1)
    if qtype == QuantType.Q4_0:
        return (q.to(torch.int8) - 8).to(torch.int8)
    if qtype == QuantType.IQ4_NL:
        lut = torch.tensor(IQ4_NL_VALUES, dtype=torch.int8, device=b.device)
        return lut[q.to(torch.int32)]
    # Q5_0: bit i of the little-endian 32-bit qh (bytes 2-5) is element i's fifth bit
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device)
    high = ((b[:, 2:6, None] >> shifts) & 1).reshape(-1, 32)
    return ((q | (high << 4)).to(torch.int16) - 16).to(torch.int8)


def widen_blocks(data: torch.Tensor, qtype: QuantType) -> torch.Tensor:
    """Raw blocks uint8 [..., row_bytes] of a `WIDENED` type -> Q8_0 blocks uint8
    [..., row_bytes / bytes per block * 34] (on data's device)."""
    qtype = QuantType(qtype)
    if qtype not in WIDENED:
        raise ValueError(f"{qtype.name} blocks are not widened to Q8_0")
    nbytes = block_geometry(qtype)[1]
    if data.dtype != torch.uint8 or data.shape[-1] % nbytes:
        raise ValueError(f"{qtype.name} rows of {data.shape[-1]} bytes are no whole blocks")
    b = data.reshape(-1, nbytes)
    out = torch.cat([b[:, 0:2], _codes(b, qtype).view(torch.uint8)], dim=1)
    return out.reshape(*data.shape[:-1], data.shape[-1] // nbytes * 34)
