"""`gated_norm.skip_gate_norm_ref` as one Triton launch (CUDA; or CPU tensors under
TRITON_INTERPRET=1 in tests): a program per (row, group) holds the group's channels, adds the D
skip, gates, normalises and stores in the output dtype: one read of y, x and z and one write,
instead of ten torch passes and their launches per layer."""

import torch
import triton
import triton.language as tl


@triton.jit
def _skip_gate_norm(
    y_ptr, x_ptr, d_ptr, z_ptr, w_ptr, o_ptr, SX, SZ, P, W, eps,
    BW: tl.constexpr,
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
    tl.store(o_ptr + t * (tl.num_programs(1) * W) + c, v * r * w, mask=m)


def skip_gate_norm_triton(y, x, D, z, weight, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """y [T, H, P] float32, x [T, H, P] and z [T, H * P] with contiguous rows (any row stride),
    D [H], weight [G, H * P / G] -> [T, H * P] in `dtype`."""
    t, h, p = y.shape
    g, w = weight.shape
    y = y.float().contiguous()
    x, z = _rows(x.reshape(t, h * p)), _rows(z)
    out = torch.empty(t, h * p, dtype=dtype, device=y.device)
    bw = triton.next_power_of_2(w)
    warps = 4 if bw <= 1024 else 8 if bw <= 4096 else 16
    _skip_gate_norm[(t, g)](y, x, D.float().contiguous(), z, weight.float().contiguous(), out,
                            x.stride(0), z.stride(0), p, w, eps, BW=bw,
                            num_warps=warps)  # fmt: skip
    return out


def _rows(v: torch.Tensor) -> torch.Tensor:
    """[T, C] whose rows are contiguous (a column slice of a wider row stays a view)."""
    return v if v.stride(1) == 1 else v.contiguous()
