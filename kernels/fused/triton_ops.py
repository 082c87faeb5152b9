"""Triton kernels of `ops` (CUDA; or CPU tensors under TRITON_INTERPRET=1 in tests). One program
per row; float32 in and out, sums in float32 like the references."""

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm(x_ptr, r_ptr, s_ptr, w_ptr, y_ptr, D, eps, BD: tl.constexpr, ADD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BD)
    m = c < D
    v = tl.load(x_ptr + row * D + c, mask=m, other=0.0)
    if ADD:
        v += tl.load(r_ptr + row * D + c, mask=m, other=0.0)
        tl.store(s_ptr + row * D + c, v, mask=m)
    inv = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / D + eps)
    w = tl.load(w_ptr + c, mask=m, other=0.0)
    tl.store(y_ptr + row * D + c, v * inv * w, mask=m)


@triton.jit
def _silu_mul(gu_ptr, y_ptr, H, BH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BH + tl.arange(0, BH)
    m = c < H
    g = tl.load(gu_ptr + row * 2 * H + c, mask=m, other=0.0)
    u = tl.load(gu_ptr + row * 2 * H + H + c, mask=m, other=0.0)
    tl.store(y_ptr + row * H + c, g / (1.0 + tl.exp(-g)) * u, mask=m)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def rms_norm_cuda(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x2 = _rows(x)
    y = torch.empty_like(x2)
    d = x2.shape[1]
    bd = triton.next_power_of_2(d)
    _rms_norm[(x2.shape[0],)](x2, x2, x2, w, y, d, eps, BD=bd, ADD=False, num_warps=4)
    return y.reshape(x.shape)


def add_rms_norm_cuda(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float):
    x2, r2 = _rows(x), _rows(r)
    s, y = torch.empty_like(x2), torch.empty_like(x2)
    d = x2.shape[1]
    bd = triton.next_power_of_2(d)
    _rms_norm[(x2.shape[0],)](x2, r2, s, w, y, d, eps, BD=bd, ADD=True, num_warps=4)
    return s.reshape(x.shape), y.reshape(x.shape)


def silu_mul_cuda(gu: torch.Tensor, hidden: int) -> torch.Tensor:
    g2 = _rows(gu)
    y = torch.empty(g2.shape[0], hidden, dtype=gu.dtype, device=gu.device)
    bh = 1024
    _silu_mul[(g2.shape[0], triton.cdiv(hidden, bh))](g2, y, hidden, BH=bh, num_warps=4)
    return y.reshape(*gu.shape[:-1], hidden)
