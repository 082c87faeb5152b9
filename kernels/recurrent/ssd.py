"""The Mamba-2 selective state-space scan (SSD): plain-torch references of the decode step, the
token-by-token scan and the chunked prefill, from any carried state.

Per head h with a state S [P, N] (head_dim rows, state_size columns) and per token the step
dt > 0 (softplus and bias already applied), the head's decay A < 0, its input x [P] and its
group's B, C [N] (G groups of H / G heads share B and C):

    S <- exp(dt A) S + dt x B^T
    y  = S C                                  (the D skip and the gate are the caller's)

Everything computes in float32: the state is a running sum over the whole context.
"""

from typing import NamedTuple

import torch

CHUNK = 64  # tokens per block of the chunked form


class Mamba2Mixer(NamedTuple):
    """One Mamba-2 layer's mixer weights between its projections: the depthwise conv's taps
    conv_w [Cc, K] and bias [Cc] (or None), the step's bias dt_bias [H], the decay A [H] (< 0),
    the skip D [H], the group norm's weight norm_w [Din] and eps, the head and group counts."""

    conv_w: torch.Tensor
    conv_b: torch.Tensor | None
    dt_bias: torch.Tensor
    A: torch.Tensor
    D: torch.Tensor
    norm_w: torch.Tensor
    eps: float
    heads: int
    groups: int


def use_triton(state: torch.Tensor) -> bool:
    """Whether `ssd_step` runs as a Triton launch: on CUDA (a test sets it under
    TRITON_INTERPRET=1 to run the kernel through a model on CPU)."""
    return state.is_cuda


def _heads(t: torch.Tensor, n_heads: int, dim: int) -> torch.Tensor:
    """B or C with groups on `dim` repeated to one per head (group g serves heads g*H/G..)."""
    return t.float().repeat_interleave(n_heads // t.shape[dim], dim=dim)


def ssd_step_ref(x, dt, A, B, C, state: torch.Tensor) -> torch.Tensor:
    """One token of S sequences: x [S, H, P], dt [S, H], A [H], B and C [S, G, N], state
    [S, H, P, N] float32, updated in place. Returns y [S, H, P] float32."""
    h = x.shape[1]
    x, dt = x.float(), dt.float()
    b, c = _heads(B, h, 1), _heads(C, h, 1)  # [S, H, N]
    state.mul_(torch.exp(dt * A.float())[..., None, None])
    state.add_((dt[..., None] * x)[..., None] * b[:, :, None, :])
    return torch.einsum("shpn,shn->shp", state, c)


def ssd_step(x, dt, A, B, C, state: torch.Tensor) -> torch.Tensor:
    """`ssd_step_ref`; on CUDA one Triton launch (`triton_step.ssd_step_triton`)."""
    if use_triton(state) and state.is_contiguous():
        from localllm.kernels.recurrent.triton_step import ssd_step_triton  # (no triton on CPU)

        return ssd_step_triton(x, dt, A, B, C, state)
    return ssd_step_ref(x, dt, A, B, C, state)


def ssd_scan(x, dt, A, B, C, state: torch.Tensor) -> torch.Tensor:
    """One sequence token by token (the recurrent form): x [T, H, P], dt [T, H], B and C
    [T, G, N], state [H, P, N] float32 updated in place. Returns y [T, H, P] float32."""
    s = state[None]
    out = [ssd_step_ref(x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1], s)
           for t in range(x.shape[0])]  # fmt: skip
    return torch.cat(out) if out else x.new_zeros(x.shape, dtype=torch.float32)


def ssd_chunked(x, dt, A, B, C, state: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """One sequence's prefill in blocks of `chunk` tokens (matmuls within a block, the recurrence
    only between blocks); same arguments and result as `ssd_scan`.

    Within a block of L tokens, with c_i the cumulative log decay sum_{k<=i} dt_k A: outputs are
    y_i = exp(c_i) S0 C_i + sum_{j<=i} exp(c_i - c_j) (C_i . B_j) dt_j x_j, and the state
    leaves as exp(c_L) S0 + sum_j exp(c_L - c_j) dt_j x_j B_j^T."""
    n_heads = x.shape[1]
    xs = x.float().transpose(0, 1)  # [H, T, P]
    dts = dt.float().t()  # [H, T]
    bs = _heads(B, n_heads, 1).transpose(0, 1)  # [H, T, N]
    cs = _heads(C, n_heads, 1).transpose(0, 1)
    a = A.float()[:, None]
    out = torch.empty_like(xs)
    s = state.float()
    for start in range(0, xs.shape[1], chunk):
        e = min(start + chunk, xs.shape[1])
        xc, bc, cc, dtc = xs[:, start:e], bs[:, start:e], cs[:, start:e], dts[:, start:e]
        c = (dtc * a).cumsum(-1)  # [H, L]
        diff = c[:, :, None] - c[:, None, :]  # c_i - c_j
        causal = torch.ones(e - start, e - start, dtype=torch.bool, device=xs.device).tril()
        # masked before exp: above the diagonal c_i - c_j > 0 could overflow
        decay = torch.where(causal, diff, torch.full_like(diff, -torch.inf)).exp()
        u = xc * dtc[..., None]  # dt_j x_j [H, L, P]
        scores = (cc @ bc.transpose(-1, -2)) * decay  # [H, L, L]
        out[:, start:e] = scores @ u + c.exp()[..., None] * (cc @ s.transpose(-1, -2))
        last = c[:, -1:]  # [H, 1]
        s = last.exp()[..., None] * s + (u * (last - c).exp()[..., None]).transpose(-1, -2) @ bc
    state.copy_(s)
    return out.transpose(0, 1).contiguous()
