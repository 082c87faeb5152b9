"""Experts prepared once for CPU compute: each expert's gate/up/down raw ggml blocks turned into
`prepare_linear` weights (int4pack for Q4_0/Q4_1/Q4_K, an fp16 copy for Q5_*/Q8_0/Q6_K, views of
the blocks for F16/BF16/F32 and for the types with no fast CPU form, e.g. MXFP4), so a routed
expert is never dequantized to float32 on every use.

Every CPU residency mode (resident, streamed, read ahead) prepares through `prepare_expert`, so a
given expert is computed with the same strategy and the same bits wherever it lives: greedy
tokens do not depend on residency. `prepared_expert_nbytes` is what preparing one matrix adds to
memory, for the residency planner and the streaming pool.
"""

from dataclasses import dataclass

import torch

from localllm.kernels.moe.experts import ExpertBlocks, ExpertFormat
from localllm.kernels.quant.affine import CODE_BITS
from localllm.kernels.quant.linear import PreparedLinear, choose_strategy, prepare_linear
from localllm.kernels.quant.types import QuantType

_IN_PLACE = (QuantType.F16, QuantType.BF16, QuantType.F32)  # dense strategies that view the blocks


@dataclass(frozen=True, slots=True)
class PreparedExpert:
    """One expert's prepared gate and up ([hidden, dim]) and down ([dim, hidden]) linears;
    `nbytes` counts only what they own (views of the raw blocks are the raw blocks' bytes)."""

    gate: PreparedLinear
    up: PreparedLinear
    down: PreparedLinear
    nbytes: int


def _strategy(qtype: QuantType, rows: int, cols: int, precise: bool) -> str:
    """The strategy `prepare_linear` takes for this matrix on the CPU (its precise rule too)."""
    strategy = choose_strategy(qtype, (rows, cols), "cpu")
    if precise and strategy in ("dense_f16", "dense_bf16"):
        return "dense_f32" if qtype == QuantType.F32 else "dequant_tiles"
    return strategy


def prepared_expert_nbytes(qtype: QuantType, rows: int, cols: int, precise: bool = False) -> int:
    """Bytes that preparing one expert matrix [rows, cols] of `qtype` adds next to its raw blocks
    (exact for the CPU strategy `prepare_expert` uses; 0 where the prepared form is a view)."""
    qtype = QuantType(qtype)
    strategy, n = _strategy(qtype, rows, cols, precise), rows * cols
    if strategy == "int4pack":
        planes = 1 if CODE_BITS[qtype] == 4 else 2
        # packed codes planes * K/2, bf16 (scale, zero) planes * K/32 * 4, fp32 a and b K/32 * 8
        return n * planes // 2 + n * planes // 8 + n // 4
    if strategy in ("dense_f16", "dense_bf16", "dense_f32"):
        return 0 if qtype in _IN_PLACE else n * (4 if strategy == "dense_f32" else 2)
    return 0  # dequant_tiles keeps (a view of) the raw blocks


def _owned_nbytes(lin: PreparedLinear, raw: torch.Tensor) -> int:
    """Bytes of the tensors `lin` holds that do not share the raw blocks' storage."""
    base = raw.untyped_storage().data_ptr()
    return sum(
        t.numel() * t.element_size()
        for t in vars(lin).values()
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() != base
    )


def prepare_expert(
    blocks: ExpertBlocks, fmt: ExpertFormat, precise: bool = False, native=None
) -> PreparedExpert:
    """Prepare one expert's raw blocks (CPU tensors) for `expert_ffn_one`; `precise` takes
    `prepare_linear`'s exact strategies (dequantize + fp32 values); `native` (the loaded native
    CPU kernels, `kernels.cpu.native`): matrices of the types their block linears take run there
    on the raw blocks (views, nothing copied), e.g. gpt-oss's MXFP4 experts, whose biases and
    clamped SwiGLU the fused expert kernels do not take."""
    d, h = fmt.dim, fmt.hidden
    parts = (
        (blocks.gate, fmt.gate, h, d),
        (blocks.up, fmt.up, h, d),
        (blocks.down, fmt.down, d, h),
    )
    lins = [
        prepare_linear(raw, qt, (rows, cols), precise=precise, native=native)
        for raw, qt, rows, cols in parts
    ]
    owned = sum(_owned_nbytes(lin, p[0]) for lin, p in zip(lins, parts, strict=True))
    return PreparedExpert(*lins, nbytes=owned)


def prepared_format_nbytes(fmt: ExpertFormat, precise: bool = False) -> int:
    """`prepared_expert_nbytes` summed over an expert's gate, up and down."""
    d, h = fmt.dim, fmt.hidden
    return (
        prepared_expert_nbytes(fmt.gate, h, d, precise)
        + prepared_expert_nbytes(fmt.up, h, d, precise)
        + prepared_expert_nbytes(fmt.down, d, h, precise)
    )
