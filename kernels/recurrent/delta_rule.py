"""The gated delta rule (Gated DeltaNet's linear attention: Qwen3-Next, Qwen3.5): plain-torch
references of the decode step and of the chunked prefill.

Per value head, with a state S [Dk, Dv] (keys on rows, values on columns) and per token the
decay g <= 0 (log space), the write strength beta in (0, 1), key k and query q [Dk], value v [Dv]:

    S <- exp(g) S
    S <- S + k (beta (v - S^T k))^T        (the delta rule: write what S does not yet predict)
    o  = S^T q

q and k arrive L2-normalised, q already scaled by 1 / sqrt(Dk), and as many heads as v (a
grouped model repeats its key heads first). Everything computes in float32: the state is a
running sum over the whole context and rounding errors would pile up in it.
"""

import torch

CHUNK = 64  # tokens per block of the chunked form (FLA's and transformers' size)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim: FLA's and transformers' l2norm."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule_step_ref(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """One token of B sequences: q, k [B, H, Dk], v [B, H, Dv], g and beta [B, H], state
    [B, H, Dk, Dv] float32, updated in place. Returns o [B, H, Dv] float32."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    state.mul_(g.exp()[..., None, None])
    pred = torch.einsum("bhkv,bhk->bhv", state, k)
    delta = (v - pred) * beta[..., None]
    state.add_(k[..., :, None] * delta[..., None, :])
    return torch.einsum("bhkv,bhk->bhv", state, q)


def delta_rule_step(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """`delta_rule_step_ref` (the torch ops run on any device)."""
    return delta_rule_step_ref(q, k, v, g, beta, state)


def delta_rule_scan(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """One sequence token by token (the recurrent form): q, k [T, H, Dk], v [T, H, Dv], g and
    beta [T, H], state [H, Dk, Dv] float32 updated in place. Returns o [T, H, Dv]."""
    s = state[None]
    out = [delta_rule_step_ref(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1],
                               beta[t : t + 1], s) for t in range(q.shape[0])]  # fmt: skip
    return torch.cat(out) if out else v.new_zeros(v.shape, dtype=torch.float32)


def delta_rule_chunked(q, k, v, g, beta, state: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """One sequence's prefill in blocks of `chunk` tokens (the chunked form: matmuls within a
    block, the recurrence only between blocks); same arguments and result as `delta_rule_scan`.

    Within a block of L tokens, with c_i the cumulative log decay up to token i and D_ij =
    exp(c_i - c_j) for j <= i: the delta rule's writes u_i = beta_i (v_i - S_{i-1}^T k_i) solve
    the unit lower-triangular system (I + A) U = beta (V - exp(c) K S0), A_ij = beta_i k_i.k_j
    D_ij for j < i; outputs are exp(c_i) q_i^T S0 + sum_{j<=i} q_i.k_j D_ij u_j, and the state
    leaves as exp(c_L) S0 + sum_j exp(c_L - c_j) k_j u_j^T."""
    q, k, v, g, beta = (t.float().transpose(0, 1) for t in (q, k, v, g, beta))  # heads first
    n = q.shape[1]
    out = torch.empty_like(v)
    s = state
    for a in range(0, n, chunk):
        e = min(a + chunk, n)
        qc, kc, vc, bc = q[:, a:e], k[:, a:e], v[:, a:e], beta[:, a:e, None]
        c = g[:, a:e].cumsum(-1)  # [H, L]
        decay = (c[:, :, None] - c[:, None, :]).tril().exp().tril()  # D_ij, zero above
        kk = kc @ kc.transpose(-1, -2)
        lower = (bc * kk * decay).tril(-1)
        eye = torch.eye(e - a, dtype=lower.dtype, device=lower.device)
        rhs = bc * (vc - (kc * c.exp()[..., None]) @ s)
        u = torch.linalg.solve_triangular(eye + lower, rhs, upper=False, unitriangular=True)
        qk = (qc @ kc.transpose(-1, -2)) * decay
        out[:, a:e] = (qc * c.exp()[..., None]) @ s + qk @ u
        last = c[:, -1:]  # [H, 1]
        s = last.exp()[..., None] * s + (kc * (last - c).exp()[..., None]).transpose(-1, -2) @ u
    state.copy_(s)
    return out.transpose(0, 1).contiguous()
