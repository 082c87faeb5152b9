"""Triton kernels of `ops` (CUDA; or CPU tensors under TRITON_INTERPRET=1 in tests). One program
per row (RMSNorm) or per 1,024 values of a row (SiLU product); float32 in and out, sums in float32
like the references. With QUANT the kernel also writes its output quantized for the dp4a GEMV
that reads it next (`triton_packed.QuantizedX`), which saves that GEMV its quantization launch.
With a `LoraShrink` it also runs the LoRA shrink of that linear (`engine.lora.delta`'s "epilogue"
scheme), which saves the shrink's own launch: the norm in extra programs, each recomputing the
row's norm and dotting it with a few rows of the stacked A; the SiLU product split over its
programs' columns with float32 atomics, or each column block's partial stored for the GEMV's
epilogue to sum (`LoraShrink.ps`)."""

import torch
import triton
import triton.language as tl

from localllm.kernels import pdl
from localllm.kernels.fused.lora_delta import LoraShrink
from localllm.kernels.fused.triton_lora import a_rows, shrink_rows
from localllm.kernels.quant.triton_dp4a import quant_groups
from localllm.kernels.quant.triton_packed import QuantizedX, quantized_out


@triton.jit
def _stream(
    x_ptr, r_ptr, rw_ptr, e_ptr, row, c, m, D, rs, ADD: tl.constexpr, KSEL: tl.constexpr,
    EXTRA: tl.constexpr,
):  # fmt: skip
    """A row of the stream: x, plus rs times r or the weighted sum of KSEL rows of r (and of
    EXTRA's row of e: shared experts' output); rs: a residual scale, Granite's; 1.0 elsewhere,
    where the product is exact."""
    v = tl.load(x_ptr + row * D + c, mask=m, other=0.0)
    if ADD:
        if KSEL == 0:
            v += rs * tl.load(r_ptr + row * D + c, mask=m, other=0.0)
        else:  # r is the weighted sum of KSEL rows per row, in order (`ops.WeightedRows`)
            acc = tl.zeros(v.shape, dtype=tl.float32)
            for j in tl.static_range(KSEL):  # unrolled: the rows' loads go out together
                rj = row * KSEL + j
                acc += tl.load(rw_ptr + rj) * tl.load(r_ptr + rj * D + c, mask=m, other=0.0)
            if EXTRA:  # (after the sum: the order of `combine` then `+ shared`)
                acc += tl.load(e_ptr + row * D + c, mask=m, other=0.0)
            v += rs * acc
    return v


@triton.jit
def _norm_row(
    x_ptr, r_ptr, rw_ptr, e_ptr, s_ptr, w, y_ptr, q_ptr, d_ptr, s16_ptr, xs_ptr, row, c, m, D,
    eps, rs, BD: tl.constexpr, ADD: tl.constexpr, KSEL: tl.constexpr, QUANT: tl.constexpr,
    RN: tl.constexpr, PDL: tl.constexpr, EXTRA: tl.constexpr,
):  # fmt: skip
    pdl.gdc_wait(PDL)
    v = _stream(x_ptr, r_ptr, rw_ptr, e_ptr, row, c, m, D, rs, ADD, KSEL, EXTRA)
    if ADD:
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
def _norm_shrink(
    x_ptr, r_ptr, rw_ptr, e_ptr, w, a_ptr, lw_ptr, t_ptr, row, c, m, D, eps, rs, slw, R, PS, part,
    ADD: tl.constexpr, KSEL: tl.constexpr, BRL: tl.constexpr, PDL: tl.constexpr,
    EXTRA: tl.constexpr,
):  # fmt: skip
    """The next linear's LoRA shrink from this norm: t[row, r] = (y . A[r]) * W[row, r] for BRL
    rows r of the stacked A (a weight: loaded before the wait), the norm recomputed from the
    stream (it is in L2); a plain store, one program per (row, r) (PS > 1: partial 0 of a
    partials buffer, `LoraShrink.ps`)."""
    r = (part - 1) * BRL + tl.arange(0, BRL)
    rm = r < R
    a = tl.load(a_ptr + r[:, None].to(tl.int64) * D + c[None, :], mask=rm[:, None] & m[None, :],
                other=0.0).to(tl.float32)  # fmt: skip
    pdl.gdc_wait(PDL)
    v = _stream(x_ptr, r_ptr, rw_ptr, e_ptr, row, c, m, D, rs, ADD, KSEL, EXTRA)
    inv = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / D + eps)
    y = v * inv * w
    acc = tl.sum(y[None, :] * a, axis=1) * tl.load(lw_ptr + row * slw + r, mask=rm, other=0.0)
    tl.store(t_ptr + (row * R + r) * PS, acc, mask=rm)


@triton.jit
def _rms_norm(
    x_ptr, r_ptr, rw_ptr, e_ptr, s_ptr, w_ptr, y_ptr, q_ptr, d_ptr, s16_ptr, xs_ptr, a_ptr,
    lw_ptr, t_ptr, D, eps, rs, slw, R, PS,
    BD: tl.constexpr, ADD: tl.constexpr, KSEL: tl.constexpr, QUANT: tl.constexpr,
    RN: tl.constexpr, PDL: tl.constexpr, LORA: tl.constexpr, BRL: tl.constexpr,
    EXTRA: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BD)
    m = c < D
    pdl.gdc_begin(PDL)
    w = tl.load(w_ptr + c, mask=m, other=0.0)  # a weight: no earlier kernel writes it
    args = (x_ptr, r_ptr, rw_ptr, e_ptr, s_ptr, w, y_ptr, q_ptr, d_ptr, s16_ptr, xs_ptr, row, c,
            m, D, eps, rs)  # fmt: skip
    if LORA:  # programs (row, 1..): the LoRA shrink of the linear that reads y
        part = tl.program_id(1)
        if part > 0:
            _norm_shrink(x_ptr, r_ptr, rw_ptr, e_ptr, w, a_ptr, lw_ptr, t_ptr, row, c, m, D, eps,
                         rs, slw, R, PS, part, ADD, KSEL, BRL, PDL, EXTRA)  # fmt: skip
        else:
            _norm_row(*args, BD, ADD, KSEL, QUANT, RN, PDL, EXTRA)
    else:
        _norm_row(*args, BD, ADD, KSEL, QUANT, RN, PDL, EXTRA)


@triton.jit
def _silu_mul(
    gu_ptr, y_ptr, q_ptr, d_ptr, s16_ptr, xs_ptr, a_ptr, lw_ptr, t_ptr, H, slw, R, RSTEP, PS,
    BH: tl.constexpr, QUANT: tl.constexpr, RN: tl.constexpr, PDL: tl.constexpr,
    LORA: tl.constexpr, BRS: tl.constexpr, PART: tl.constexpr = False, APF: tl.constexpr = False,
):  # fmt: skip
    """Program (row, column block, r): y = silu(g) * u of its columns (and their quantized
    groups), stored by the r = 0 programs; with LORA, rows r * RSTEP.. of the next linear's
    shrink over those columns (one r program and RSTEP = R unless the shrink is split), added
    into t or, with PART, stored as the column block's partial (`LoraShrink.ps`). APF: the
    first BRS rows of A load before the wait for the previous kernel (a weight, not its
    output), so their latency hides behind that kernel's end."""
    pdl.gdc_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BH + tl.arange(0, BH)
    m = c < H
    lo = tl.program_id(2) * RSTEP
    if LORA and APF:
        a0 = a_rows(a_ptr, lo + tl.arange(0, BRS), c, m, H, R)
    pdl.gdc_wait(PDL)
    g = tl.load(gu_ptr + row * 2 * H + c, mask=m, other=0.0)
    u = tl.load(gu_ptr + row * 2 * H + H + c, mask=m, other=0.0)
    y = g / (1.0 + tl.exp(-g)) * u
    first = tl.program_id(2) == 0
    tl.store(y_ptr + row * H + c, y, mask=m & first)
    if QUANT:  # H is a multiple of 32: a program's BH values are whole groups
        grp = tl.program_id(1) * (BH // 32) + tl.arange(0, BH // 32)
        k32 = row * (H // 32)
        q_row, s16_row = q_ptr + row * (H // 4), s16_ptr + row * (H // 16)
        yg = tl.reshape(y, (BH // 32, 32))
        gm = (grp < H // 32) & first
        quant_groups(yg, grp, gm, q_row, d_ptr + k32, s16_row, xs_ptr + k32, BH // 32, RN)
    if LORA:  # the next linear's LoRA shrink, split over the programs' columns: float32
        slot, start = tl.program_id(1), lo  # (partials: one a column block)
        if APF:
            shrink_rows(y, a0, lo + tl.arange(0, BRS), row, slot, lw_ptr, slw, t_ptr, R, PS, PART)
            start = lo + BRS
        for r0 in range(start, tl.minimum(lo + RSTEP, R), BRS):
            r = r0 + tl.arange(0, BRS)
            a = a_rows(a_ptr, r, c, m, H, R)
            shrink_rows(y, a, r, row, slot, lw_ptr, slw, t_ptr, R, PS, PART)


# rows of the stacked LoRA A per extra norm program (rank 16: 4 programs beside the norm's), and
# per step of the SiLU programs' loop (a [8, 1,024] tile of A a program at a time)
NORM_LORA_ROWS = 4
SILU_LORA_ROWS = 8
# with a shrink, split its A rows over this many per SiLU program (a third grid axis; each such
# program recomputes its columns' y) instead of one program looping over all R: R / 8 dependent
# steps per program at 14 column programs for an 8B's down projection. None: no split; a
# multiple of SILU_LORA_ROWS
SILU_LORA_RSTEP: int | None = 8
# with a shrink, columns per SiLU program (a multiple of 32) instead of 1,024: more programs share
# an 8B's 14,336-wide shrink (14 at 1,024, where one adapter's SiLU took 6.6 us against 1.6
# without: H100, 2026-12-07); None: 1,024. Both on since an H200 timed them (2026-12-07 18:18 UTC,
# tests/perf/results/lora.md: one rank-16 adapter +20.5 % over the base with neither, +15.8 %
# narrow, +15.0 % narrow with the row split and the combine's, COMBINE_LORA_RSTEP)
SILU_LORA_BH: int | None = 256
# with a shrink, each SiLU program's first rows of A load before it waits for the gate|up GEMV
# (PDL). Off: timed only together with 4 rank rows a chunk in the GEMV epilogue (slower on its
# own, since removed), not alone (H100, 2026-12-08 00:14 UTC)
SILU_LORA_PREFETCH = False


def norm_warps(d: int) -> int:
    """Warps of one RMSNorm row: 8 up to 2,048 values, 16 above (H200, one decode row with its
    quantized twin: 2,048 wide 2.01 us at 8 warps vs 2.27 at 4; 4,096 wide 2.57 at 16 vs 2.89;
    tests/perf/bench_norm.py)."""
    return 8 if d <= 2048 else 16


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def _lora(shrink: LoraShrink | None, rows: int, d: int, like: torch.Tensor):
    """The kernels' LoRA arguments (a, W, t, W's row stride, R) and R, 0 without a shrink."""
    if shrink is None:
        return (like, like, like, 0, 0), 0
    a, w, t = shrink.a, shrink.w, shrink.t
    r = a.shape[0]
    if a.shape[1] != d or not a.is_contiguous() or w.stride(1) != 1 or w.shape[0] < rows:
        raise ValueError(f"LoRA shrink A {tuple(a.shape)} / W {tuple(w.shape)} for {rows} x {d}")
    fits = t.shape[0] >= rows and t.shape[1] == r and t.is_contiguous()
    if not fits or t.shape[2:] != ((shrink.ps,) if shrink.ps else ()):
        raise ValueError(f"LoRA scratch {tuple(t.shape)} does not fit {rows} rows of rank {r}")
    return (a, w, t, w.stride(0), r), r


def _norm(x2, r2, rw, w, eps, quant, shrink, add, warps=None, scale=1.0, re=None):
    s, y = torch.empty_like(x2), torch.empty_like(x2)
    rows, d = x2.shape
    xq, qa = quantized_out(rows, d, quant, y)
    la, r = _lora(shrink, rows, d, y)
    ps = shrink.ps if shrink is not None and shrink.ps else 1  # t's stride per value
    bd = triton.next_power_of_2(d)
    ksel = 0 if rw is None else rw.shape[-1]
    if rw is not None and r2.shape[0] != rows * ksel:
        raise ValueError(f"{r2.shape[0]} rows do not hold {ksel} per row of {rows}")
    if re is not None and (rw is None or re.numel() != rows * d):
        raise ValueError("an extra residual row comes with weighted rows, one per row of x")
    e2 = x2 if re is None else _rows(re)
    _rms_norm[(rows, 1 + triton.cdiv(r, NORM_LORA_ROWS))](
        x2, r2, x2 if rw is None else rw.float().contiguous(), e2, s, w, y, *qa, *la[:3], d, eps,
        float(scale), *la[3:], ps, BD=bd, ADD=add, KSEL=ksel, QUANT=xq is not None,
        RN=x2.is_cuda, LORA=r > 0, BRL=NORM_LORA_ROWS, EXTRA=re is not None,
        num_warps=warps or norm_warps(d), **pdl.launch_options(pdl.enabled(x2)),
    )  # fmt: skip
    if shrink is not None:  # (one program a (row, A rows): partial 0 is the whole shrink)
        shrink.wrote(1)
    return s, y, xq


def rms_norm_cuda(
    x: torch.Tensor, w: torch.Tensor, eps: float, quant: bool = False,
    shrink: LoraShrink | None = None,
) -> tuple[torch.Tensor, QuantizedX | None]:  # fmt: skip
    """norm(x) and its quantized twin; `shrink`: the next linear's LoRA shrink into its scratch."""
    x2 = _rows(x)
    _, y, xq = _norm(x2, x2, None, w, eps, quant, shrink, False)
    return y.reshape(x.shape), xq


def add_rms_norm_cuda(
    x: torch.Tensor,
    r: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    quant: bool = False,
    warps: int | None = None,
    rw: torch.Tensor | None = None,
    shrink: LoraShrink | None = None,
    scale: float = 1.0,
    re: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, QuantizedX | None]:
    """x + scale * r, its norm and quantized twin; with `rw` [T, k], r [T * k, D] holds k rows
    per row of x, summed with those weights (`ops.WeightedRows`), and `re` [T, D] added to that
    sum (its `extra`); `shrink`: the next linear's LoRA shrink into its scratch."""
    s, y, xq = _norm(_rows(x), _rows(r), rw, w, eps, quant, shrink, True, warps, scale, re)
    return s.reshape(x.shape), y.reshape(x.shape), xq


def silu_mul_cuda(
    gu: torch.Tensor, hidden: int, quant: bool = False, shrink: LoraShrink | None = None
) -> tuple[torch.Tensor, QuantizedX | None]:
    """silu(g) * u and its quantized twin; `shrink`: the next linear's LoRA shrink, added
    into its scratch (zero before, as every LoRA call leaves it)."""
    g2 = _rows(gu)
    y = torch.empty(g2.shape[0], hidden, dtype=gu.dtype, device=gu.device)
    xq, qa = quantized_out(g2.shape[0], hidden, quant, y)
    la, r = _lora(shrink, g2.shape[0], hidden, y)
    bh = SILU_LORA_BH if r > 0 and SILU_LORA_BH else 1024
    ps = shrink.ps if shrink is not None else 0
    while ps and triton.cdiv(hidden, bh) > ps:  # wider blocks: fewer partials
        bh *= 2
    rstep = SILU_LORA_RSTEP if r > 0 and SILU_LORA_RSTEP else max(r, 1)
    grid = (g2.shape[0], triton.cdiv(hidden, bh), triton.cdiv(max(r, 1), rstep))
    flags = {"QUANT": xq is not None, "RN": gu.is_cuda, **pdl.launch_options(pdl.enabled(gu))}
    _silu_mul[grid](g2, y, *qa, *la[:3], hidden, *la[3:], rstep, ps, BH=bh, num_warps=4,
                    LORA=r > 0, BRS=SILU_LORA_ROWS, PART=ps > 0, APF=SILU_LORA_PREFETCH,
                    **flags)  # fmt: skip
    if shrink is not None:
        shrink.wrote(grid[1])
    return y.reshape(*gu.shape[:-1], hidden), xq


@triton.jit
def _gated_add(x_ptr, y_ptr, s_ptr, g_ptr, o_ptr, h_ptr, D, BD: tl.constexpr, DOT: tl.constexpr):
    """DOT: the gate's logit is h's row . g (a weight [D]), each program summing it whole."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BD + tl.arange(0, BD)
    m = c < D
    at = row * D + c
    if DOT:
        acc = tl.zeros([BD], dtype=tl.float32)
        for k0 in range(0, D, BD):
            kk = k0 + tl.arange(0, BD)
            km = kk < D
            hv = tl.load(h_ptr + row * D + kk, mask=km, other=0.0)
            acc += hv * tl.load(g_ptr + kk, mask=km, other=0.0)
        gate = tl.sigmoid(tl.sum(acc, axis=0))
    else:
        gate = tl.sigmoid(tl.load(g_ptr + row))
    v = tl.load(x_ptr + at, mask=m, other=0.0) + tl.load(y_ptr + at, mask=m, other=0.0)
    tl.store(o_ptr + at, v + gate * tl.load(s_ptr + at, mask=m, other=0.0), mask=m)


def gated_add_cuda(x, y, s, g, h=None) -> torch.Tensor:
    """`ops.gated_add` in one launch: x, y, s [T, D] float32, g [T, 1] float32; with `h` [T, D]
    float32, g is a weight [D] and the gate's logits h @ g are summed in the same launch."""
    x, y, s = (t.reshape(-1, t.shape[-1]).contiguous() for t in (x, y, s))
    t, d = x.shape
    out = torch.empty_like(x)
    bd = min(1024, triton.next_power_of_2(d))
    hr = x if h is None else h.reshape(-1, d).contiguous()
    _gated_add[(t, triton.cdiv(d, bd))](x, y, s, g.reshape(-1).float().contiguous(), out, hr, d,
                                        BD=bd, DOT=h is not None)  # fmt: skip
    return out
