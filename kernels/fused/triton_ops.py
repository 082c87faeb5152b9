"""Triton kernels of `ops` (CUDA; or CPU tensors under TRITON_INTERPRET=1 in tests). One program
per row (RMSNorm) or per 1,024 values of a row (SiLU product); float32 in and out, sums in float32
like the references. With QUANT the kernel also writes its output quantized for the dp4a GEMV
that reads it next (`triton_packed.QuantizedX`), which saves that GEMV its quantization launch."""

import torch
import triton
import triton.language as tl

from localllm.kernels import pdl
from localllm.kernels.quant.triton_dp4a import quant_groups
from localllm.kernels.quant.triton_packed import QuantizedX, empty_quantized


@triton.jit
def _rms_norm(
    x_ptr, r_ptr, rw_ptr, s_ptr, w_ptr, y_ptr, q_ptr, d_ptr, s16_ptr, xs_ptr, D, eps,
    BD: tl.constexpr, ADD: tl.constexpr, KSEL: tl.constexpr, QUANT: tl.constexpr,
    RN: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BD)
    m = c < D
    pdl.gdc_begin(PDL)
    w = tl.load(w_ptr + c, mask=m, other=0.0)  # a weight: no earlier kernel writes it
    pdl.gdc_wait(PDL)
    v = tl.load(x_ptr + row * D + c, mask=m, other=0.0)
    if ADD:
        if KSEL == 0:
            v += tl.load(r_ptr + row * D + c, mask=m, other=0.0)
        else:  # r is the weighted sum of KSEL rows per row, in order (`ops.WeightedRows`)
            acc = tl.zeros([BD], dtype=tl.float32)
            for j in tl.static_range(KSEL):  # unrolled: the rows' loads go out together
                rj = row * KSEL + j
                acc += tl.load(rw_ptr + rj) * tl.load(r_ptr + rj * D + c, mask=m, other=0.0)
            v += acc
        tl.store(s_ptr + row * D + c, v, mask=m)
    inv = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / D + eps)
    y = v * inv * w
    tl.store(y_ptr + row * D + c, y, mask=m)
    if QUANT:  # D is a multiple of 32; padding groups are masked
        g = tl.arange(0, BD // 32)
        k32 = row * (D // 32)
        q_row, s16_row = q_ptr + row * (D // 4), s16_ptr + row * (D // 16)
        yg = tl.reshape(y, (BD // 32, 32))
        quant_groups(yg, g, g < D // 32, q_row, d_ptr + k32, s16_row, xs_ptr + k32, BD // 32, RN)


@triton.jit
def _silu_mul(
    gu_ptr, y_ptr, q_ptr, d_ptr, s16_ptr, xs_ptr, H,
    BH: tl.constexpr, QUANT: tl.constexpr, RN: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.gdc_begin(PDL)
    pdl.gdc_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BH + tl.arange(0, BH)
    m = c < H
    g = tl.load(gu_ptr + row * 2 * H + c, mask=m, other=0.0)
    u = tl.load(gu_ptr + row * 2 * H + H + c, mask=m, other=0.0)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(y_ptr + row * H + c, y, mask=m)
    if QUANT:  # H is a multiple of 32: a program's BH values are whole groups
        grp = tl.program_id(1) * (BH // 32) + tl.arange(0, BH // 32)
        k32 = row * (H // 32)
        q_row, s16_row = q_ptr + row * (H // 4), s16_ptr + row * (H // 16)
        yg = tl.reshape(y, (BH // 32, 32))
        quant_groups(
            yg, grp, grp < H // 32, q_row, d_ptr + k32, s16_row, xs_ptr + k32, BH // 32, RN
        )


def norm_warps(d: int) -> int:
    """Warps of one RMSNorm row: 8 up to 2,048 values, 16 above (H200, one decode row with its
    quantized twin: 2,048 wide 2.01 us at 8 warps vs 2.27 at 4; 4,096 wide 2.57 at 16 vs 2.89;
    tests/perf/bench_norm.py)."""
    return 8 if d <= 2048 else 16


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def _quant_out(rows: int, d: int, quant: bool, like: torch.Tensor):
    """QuantizedX buffers when asked for and the row splits into 32-value groups, else None;
    plus the four kernel arguments (the output itself stands in for absent buffers)."""
    if not quant or d % 32:
        return None, (like, like, like, like)
    xq = empty_quantized(rows, d, like.device)
    return xq, (xq.words, xq.scale, xq.sum16, xq.xsum)


def rms_norm_cuda(
    x: torch.Tensor, w: torch.Tensor, eps: float, quant: bool = False
) -> tuple[torch.Tensor, QuantizedX | None]:
    x2 = _rows(x)
    y = torch.empty_like(x2)
    d = x2.shape[1]
    xq, qa = _quant_out(x2.shape[0], d, quant, y)
    bd = triton.next_power_of_2(d)
    _rms_norm[(x2.shape[0],)](
        x2,
        x2,
        x2,
        x2,
        w,
        y,
        *qa,
        d,
        eps,
        BD=bd,
        ADD=False,
        KSEL=0,
        QUANT=xq is not None,
        RN=x.is_cuda,
        num_warps=norm_warps(d),
        **pdl.launch_options(pdl.enabled(x)),
    )
    return y.reshape(x.shape), xq


def add_rms_norm_cuda(
    x: torch.Tensor,
    r: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    quant: bool = False,
    warps: int | None = None,
    rw: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, QuantizedX | None]:
    """x + r, its norm and quantized twin; with `rw` [T, k], r [T * k, D] holds k rows per row
    of x, summed with those weights (`ops.WeightedRows`)."""
    x2, r2 = _rows(x), _rows(r)
    s, y = torch.empty_like(x2), torch.empty_like(x2)
    d = x2.shape[1]
    xq, qa = _quant_out(x2.shape[0], d, quant, y)
    bd = triton.next_power_of_2(d)
    ksel = 0 if rw is None else rw.shape[-1]
    if rw is not None and r2.shape[0] != x2.shape[0] * ksel:
        raise ValueError(f"{r2.shape[0]} rows do not hold {ksel} per row of {x2.shape[0]}")
    _rms_norm[(x2.shape[0],)](
        x2,
        r2,
        x2 if rw is None else rw.float().contiguous(),
        s,
        w,
        y,
        *qa,
        d,
        eps,
        BD=bd,
        ADD=True,
        KSEL=ksel,
        QUANT=xq is not None,
        RN=x.is_cuda,
        num_warps=warps or norm_warps(d),
        **pdl.launch_options(pdl.enabled(x)),
    )
    return s.reshape(x.shape), y.reshape(x.shape), xq


def silu_mul_cuda(
    gu: torch.Tensor, hidden: int, quant: bool = False
) -> tuple[torch.Tensor, QuantizedX | None]:
    g2 = _rows(gu)
    y = torch.empty(g2.shape[0], hidden, dtype=gu.dtype, device=gu.device)
    xq, qa = _quant_out(g2.shape[0], hidden, quant, y)
    bh = 1024
    grid = (g2.shape[0], triton.cdiv(hidden, bh))
    flags = {"QUANT": xq is not None, "RN": gu.is_cuda, **pdl.launch_options(pdl.enabled(gu))}
    _silu_mul[grid](g2, y, *qa, hidden, BH=bh, num_warps=4, **flags)
    return y.reshape(*gu.shape[:-1], hidden), xq
