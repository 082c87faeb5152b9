"""Triton kernels of the recurrent layers' decode step on CUDA: one launch for the causal conv
step of every sequence (state shifted in place, bias and SiLU fused), one for the Mamba-2 scan
step (decay, write, read out). Their torch references: `causal_conv.causal_conv_step` and
`ssd.ssd_step_ref`; `tests/kernels/test_recurrent_gpu.py` compares them.

A decode step otherwise launches a dozen small torch kernels per layer (concatenate, multiply,
sum, copy back; exp, two products, einsum): here each is one launch over [sequences, channel or
head blocks]. The prompt's chunked forms stay in torch (batched matmuls).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_step_kernel(
    x_ptr, w_ptr, b_ptr, state_ptr, y_ptr, C,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = c < C
    xv = tl.load(x_ptr + s * C + c, mask=m, other=0.0)
    acc = xv * tl.load(w_ptr + c * K + (K - 1), mask=m, other=0.0)  # the newest input: last tap
    base = state_ptr + s * (K - 1) * C
    for j in tl.static_range(K - 1):  # state row j: the input K - 1 - j steps back
        acc += tl.load(base + j * C + c, mask=m, other=0.0) * tl.load(
            w_ptr + c * K + j, mask=m, other=0.0
        )
    for j in tl.static_range(K - 2):  # shift one input out, this one in
        tl.store(base + j * C + c, tl.load(base + (j + 1) * C + c, mask=m, other=0.0), mask=m)
    tl.store(base + (K - 2) * C + c, xv, mask=m)
    if HAS_BIAS:
        acc += tl.load(b_ptr + c, mask=m, other=0.0)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y_ptr + s * C + c, acc, mask=m)


def conv_step_triton(x, weight, state, bias=None, silu: bool = False) -> torch.Tensor:
    """x [S, C], weight [C, K], state [S, K - 1, C] float32 contiguous (updated in place), bias
    [C] or None -> y [S, C] float32 (bias added, then SiLU when `silu`)."""
    s, c = x.shape
    k = weight.shape[1]
    x = x.float().contiguous()
    w = weight.float().contiguous()
    y = torch.empty(s, c, dtype=torch.float32, device=x.device)
    block = min(256, triton.next_power_of_2(c))
    b = bias.float().contiguous() if bias is not None else w  # (unread without a bias)
    _conv_step_kernel[(s, triton.cdiv(c, block))](
        x, w, b, state, y, c, K=k, HAS_BIAS=bias is not None, SILU=silu, BLOCK_C=block
    )
    return y


@triton.jit
def _ssd_step_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, state_ptr, y_ptr,
    H, P, N, HEADS_PER_GROUP, G,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    sh = tl.program_id(0)  # sequence * H + head
    s = sh // H
    h = sh % H
    g = h // HEADS_PER_GROUP
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    mp, mn = p < P, n < N
    dt = tl.load(dt_ptr + sh)
    decay = tl.exp(dt * tl.load(a_ptr + h))
    bv = tl.load(b_ptr + (s * G + g) * N + n, mask=mn, other=0.0)
    cv = tl.load(c_ptr + (s * G + g) * N + n, mask=mn, other=0.0)
    xv = tl.load(x_ptr + sh * P + p, mask=mp, other=0.0)
    offs = sh * P * N + p[:, None] * N + n[None, :]
    m2 = mp[:, None] & mn[None, :]
    st = tl.load(state_ptr + offs, mask=m2, other=0.0)
    st = st * decay + (dt * xv)[:, None] * bv[None, :]
    tl.store(state_ptr + offs, st, mask=m2)
    tl.store(y_ptr + sh * P + p, tl.sum(st * cv[None, :], axis=1), mask=mp)


def ssd_step_triton(x, dt, A, B, C, state) -> torch.Tensor:
    """`ssd.ssd_step_ref` in one launch: x [S, H, P], dt [S, H], A [H], B and C [S, G, N], state
    [S, H, P, N] float32 contiguous, updated in place. Returns y [S, H, P] float32."""
    s, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    x, dt, a = x.float().contiguous(), dt.float().contiguous(), A.float().contiguous()
    b, c = B.float().contiguous(), C.float().contiguous()
    y = torch.empty(s, h, p, dtype=torch.float32, device=x.device)
    block_n = triton.next_power_of_2(n)
    block_p = max(1, min(triton.next_power_of_2(p), 4096 // block_n))  # <= 4096 values a program
    grid = (s * h, triton.cdiv(p, block_p))
    _ssd_step_kernel[grid](x, dt, a, b, c, state, y, h, p, n, h // g, g,
                           BLOCK_P=block_p, BLOCK_N=block_n)  # fmt: skip
    return y
