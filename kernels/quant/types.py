"""The ggml tensor-type table: ids and block geometry (elements per block, bytes per block).

One table for every consumer; values are the GGUF container format's, checked against `gguf`
in tests.
"""

from enum import IntEnum


class QuantType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40


# (elements per block, bytes per block)
_GEOMETRY: dict[QuantType, tuple[int, int]] = {
    QuantType.F32: (1, 4),
    QuantType.F16: (1, 2),
    QuantType.Q4_0: (32, 18),
    QuantType.Q4_1: (32, 20),
    QuantType.Q5_0: (32, 22),
    QuantType.Q5_1: (32, 24),
    QuantType.Q8_0: (32, 34),
    QuantType.Q8_1: (32, 40),
    QuantType.Q2_K: (256, 84),
    QuantType.Q3_K: (256, 110),
    QuantType.Q4_K: (256, 144),
    QuantType.Q5_K: (256, 176),
    QuantType.Q6_K: (256, 210),
    QuantType.Q8_K: (256, 292),
    QuantType.IQ2_XXS: (256, 66),
    QuantType.IQ2_XS: (256, 74),
    QuantType.IQ3_XXS: (256, 98),
    QuantType.IQ1_S: (256, 50),
    QuantType.IQ4_NL: (32, 18),
    QuantType.IQ3_S: (256, 110),
    QuantType.IQ2_S: (256, 82),
    QuantType.IQ4_XS: (256, 136),
    QuantType.I8: (1, 1),
    QuantType.I16: (1, 2),
    QuantType.I32: (1, 4),
    QuantType.I64: (1, 8),
    QuantType.F64: (1, 8),
    QuantType.IQ1_M: (256, 56),
    QuantType.BF16: (1, 2),
    QuantType.TQ1_0: (256, 54),
    QuantType.TQ2_0: (256, 66),
    QuantType.MXFP4: (32, 17),
    QuantType.NVFP4: (64, 36),
}


def block_geometry(qtype: QuantType) -> tuple[int, int]:
    """Return (elements per block, bytes per block) for a ggml type."""
    return _GEOMETRY[QuantType(qtype)]


def row_nbytes(qtype: QuantType, n_elements: int) -> int:
    """Bytes taken by `n_elements` consecutive values; they must fill whole blocks."""
    block, nbytes = block_geometry(qtype)
    if n_elements % block:
        name = QuantType(qtype).name
        raise ValueError(f"{name}: {n_elements} elements is not a multiple of {block}")
    return n_elements // block * nbytes
