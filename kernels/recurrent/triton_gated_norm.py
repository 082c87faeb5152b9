"""`gated_norm.skip_gate_norm_ref` as one Triton launch (CUDA; or CPU tensors under
TRITON_INTERPRET=1 in tests): a program per (row, group) holds the group's channels, adds the D
skip, gates, normalises and stores in the output dtype: one read of y, x and z and one write,
instead of ten torch passes and their launches per layer; with `quant` it also writes the output's
int8 rows for the out-projection's dp4a GEMV (what `quantize_x8` makes of them, one launch less)."""

import torch
import triton
import triton.language as tl

from localllm.kernels.quant.triton_dp4a import quant_groups
from localllm.kernels.quant.triton_packed import QuantizedX, quantized_out


@triton.jit
def _skip_gate_norm(
    y_ptr, x_ptr, d_ptr, z_ptr, w_ptr, o_ptr, q_ptr, qd_ptr, s16_ptr, xs_ptr, SX, SZ, P, W, eps,
    BW: tl.constexpr, QUANT: tl.constexpr, RN: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    c = g * W + tl.arange(0, BW)  # this group's channels (head c // P)
    m = tl.arange(0, BW) < W
    y = tl.load(y_ptr + t * (tl.num_programs(1) * W) + c, mask=m, other=0.0)
    x = tl.load(x_ptr + t * SX + c, mask=m, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + t * SZ + c, mask=m, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + c // P, mask=m, other=0.0)
    v = (y + d * x) * (z * tl.sigmoid(z))
    r = tl.rsqrt(tl.sum(v * v, axis=0) / W + eps)
    w = tl.load(w_ptr + c, mask=m, other=0.0)
    out = v * r * w
    tl.store(o_ptr + t * (tl.num_programs(1) * W) + c, out, mask=m)
    if QUANT:  # W a multiple of 32: the group's 32-value blocks are whole blocks of the row
        k = tl.num_programs(1) * W
        j = tl.arange(0, BW // 32)
        k32 = t * (k // 32)
        quant_groups(tl.reshape(out, (BW // 32, 32)), g * (W // 32) + j, j < W // 32,
                     q_ptr + t * (k // 4), qd_ptr + k32, s16_ptr + t * (k // 16), xs_ptr + k32,
                     BW // 32, RN)  # fmt: skip


def skip_gate_norm_triton(
    y, x, D, z, weight, eps: float, dtype: torch.dtype, quant: bool = False
) -> torch.Tensor | tuple[torch.Tensor, QuantizedX | None]:
    """y [T, H, P] float32, x [T, H, P] and z [T, H * P] with contiguous rows (any row stride),
    D [H], weight [G, H * P / G] -> [T, H * P] in `dtype`; with `quant`: (that, its int8 rows
    or None where they cannot be made: a dtype other than float32, groups not of whole 32s)."""
    t, h, p = y.shape
    g, w = weight.shape
    y = y.float().contiguous()
    x, z = _rows(x.reshape(t, h * p)), _rows(z)
    out = torch.empty(t, h * p, dtype=dtype, device=y.device)
    bw = triton.next_power_of_2(w)
    warps = 4 if bw <= 1024 else 8 if bw <= 4096 else 16
    # (a group's blocks must be whole 32s of the row: its width W, not only H * P)
    xq, qa = quantized_out(t, h * p, quant and dtype == torch.float32 and w % 32 == 0, out)
    _skip_gate_norm[(t, g)](y, x, D.float().contiguous(), z, weight.float().contiguous(), out,
                            *qa, x.stride(0), z.stride(0), p, w, eps, BW=bw, QUANT=xq is not None,
                            RN=y.is_cuda, num_warps=warps)  # fmt: skip
    return (out, xq) if quant else out


def _rows(v: torch.Tensor) -> torch.Tensor:
    """[T, C] whose rows are contiguous (a column slice of a wider row stays a view)."""
    return v if v.stride(1) == 1 else v.contiguous()
