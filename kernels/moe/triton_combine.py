"""The weighted sum of each token's k expert outputs on CUDA, as a Triton kernel launched with
programmatic dependent launch (`kernels/pdl.py`).

torch's bmm here was the one non-Triton kernel of a MoE decode layer: a cuBLAS launch neither
placed early nor releasing the next kernel, so it broke the PDL chain twice per layer. The sum
runs over the k outputs in order, in float32. Reference: `packed.combine`'s torch path. Off by
default (`packed.TRITON_COMBINE`) until it has been measured on a GPU.
"""

import torch
import triton
import triton.language as tl

from localllm.kernels import pdl

BLOCK = 1024  # values of a row per program


@triton.jit
def _combine(y_ptr, w_ptr, out_ptr, D, KSEL: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr):
    """Program (t, c): out[t, c-block] = sum over j of w[t, j] * y[t * KSEL + j, c-block]."""
    pdl.gdc_begin(PDL)
    pdl.gdc_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BD + tl.arange(0, BD)
    m = c < D
    acc = tl.zeros([BD], dtype=tl.float32)
    for j in tl.static_range(KSEL):  # unrolled: the k rows' loads go out together
        wj = tl.load(w_ptr + t * KSEL + j)
        acc += wj * tl.load(y_ptr + (t * KSEL + j) * D + c, mask=m, other=0.0)
    tl.store(out_ptr + t * D + c, acc, mask=m)


def combine_cuda(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y float32 [T * k, D], weights [T, k] -> float32 [T, D]."""
    t, k = weights.shape
    d = y.shape[-1]
    y = y.float().contiguous()
    w = weights.float().contiguous()
    out = torch.empty(t, d, dtype=torch.float32, device=y.device)
    if t == 0:
        return out
    bd = min(BLOCK, triton.next_power_of_2(d))
    grid = (t, triton.cdiv(d, bd))
    _combine[grid](y, w, out, d, KSEL=k, BD=bd, num_warps=4, **pdl.launch_options(pdl.enabled(y)))
    return out
