"""The gated delta rule (Gated DeltaNet's linear attention: Qwen3-Next, Qwen3.5): plain-torch
references of the decode step and of the chunked prefill; on CUDA the chunked prefill's recurrence
between blocks runs `triton_recurrent`'s kernel.

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
import torch.nn.functional as F

CHUNK = 64  # tokens per block of the chunked form (FLA's and transformers' size)


def _cuda32(t: torch.Tensor) -> bool:
    return t.is_cuda and t.dtype == torch.float32


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
    leaves as exp(c_L) S0 + sum_j exp(c_L - c_j) k_j u_j^T. On CUDA: `delta_rule_blocks`."""
    if _cuda32(state):
        return delta_rule_blocks(q, k, v, g, beta, state, chunk)
    q, k, v, g, beta = (t.float().transpose(0, 1) for t in (q, k, v, g, beta))  # heads first
    n = q.shape[1]
    out = torch.empty_like(v)
    s = state
    for a in range(0, n, chunk):  # one solve per block with S folded in: the fewest flops
        e = min(a + chunk, n)
        qc, kc, vc, bc = q[:, a:e], k[:, a:e], v[:, a:e], beta[:, a:e, None]
        c = g[:, a:e].cumsum(-1)  # [H, L]
        decay = (c[:, :, None] - c[:, None, :]).tril().exp().tril()  # D_ij, zero above
        lower = (bc * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
        eye = torch.eye(e - a, dtype=lower.dtype, device=lower.device)
        rhs = bc * (vc - (kc * c.exp()[..., None]) @ s)
        u = torch.linalg.solve_triangular(eye + lower, rhs, upper=False, unitriangular=True)
        qk = (qc @ kc.transpose(-1, -2)) * decay
        out[:, a:e] = (qc * c.exp()[..., None]) @ s + qk @ u
        last = c[:, -1:]  # [H, 1]
        s = last.exp()[..., None] * s + (kc * (last - c).exp()[..., None]).transpose(-1, -2) @ u
    state.copy_(s)
    return out.transpose(0, 1).contiguous()


def delta_rule_blocks(q, k, v, g, beta, state: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """`delta_rule_chunked` in two phases, the form a GPU wants: U = U0 - W S0 with U0 and W
    solved for every block at once (`chunk_prepare`), then only the recurrence between blocks
    (`chunk_scan`: one triton launch on CUDA). The sequence is padded to whole blocks with tokens
    that change nothing (g = 0, beta = 0, zero q/k/v). One more solve than the per-block form,
    which a CPU keeps (2-2.5x faster there: tests/perf/results/qwen3next.md)."""
    n = q.shape[0]
    out = chunk_scan(*chunk_prepare(q, k, v, g, beta, chunk), state)  # [H, N, L, Dv]
    return out.reshape(out.shape[0], -1, out.shape[-1])[:, :n].transpose(0, 1).contiguous()


def chunk_prepare(q, k, v, g, beta, chunk: int = CHUNK):
    """The blocks' own terms, every block at once, heads first [H, N, L, ...]: q exp(c) (qd),
    the masked q.k D (intra), U0, W, k exp(c_L - c) (kd) and each block's decay exp(c_L) [H, N]."""
    pad = -q.shape[0] % chunk

    def blocks(t: torch.Tensor) -> torch.Tensor:  # [T, H, ...] -> [H, N, L, ...], zero-padded
        t = t.float().transpose(0, 1)
        t = F.pad(t, (0, 0, 0, pad) if t.dim() == 3 else (0, pad))
        return t.reshape(t.shape[0], -1, chunk, *t.shape[2:])

    q, k, v, g, beta = (blocks(t) for t in (q, k, v, g, beta))
    c = g.cumsum(-1)  # [H, N, L]
    decay = (c[..., :, None] - c[..., None, :]).tril().exp().tril()  # D_ij, zero above
    b = beta[..., None]
    lower = (b * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    system = lower + torch.eye(chunk, dtype=lower.dtype, device=lower.device)
    u0 = torch.linalg.solve_triangular(system, b * v, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, b * c.exp()[..., None] * k, upper=False,
                                      unitriangular=True)  # fmt: skip
    intra = (q @ k.transpose(-1, -2)) * decay
    last = c[..., -1:]
    kd = k * (last - c).exp()[..., None]
    return q * c.exp()[..., None], intra, u0, w, kd, last[..., 0].exp()


def chunk_scan_ref(qd, intra, u0, w, kd, e, state: torch.Tensor) -> torch.Tensor:
    """The recurrence between blocks: outputs [H, N, L, Dv]; `state` [H, Dk, Dv] updated."""
    out = torch.empty_like(u0)
    s = state
    for i in range(u0.shape[1]):
        vn = u0[:, i] - w[:, i] @ s
        out[:, i] = qd[:, i] @ s + intra[:, i] @ vn
        s = e[:, i, None, None] * s + kd[:, i].transpose(-1, -2) @ vn
    state.copy_(s)
    return out


def chunk_scan(qd, intra, u0, w, kd, e, state: torch.Tensor) -> torch.Tensor:
    """`chunk_scan_ref`, by one triton launch on CUDA (the state tile stays in registers)."""
    L = u0.shape[2]
    if _cuda32(state) and L >= 16 and L & (L - 1) == 0:  # the kernel's dots: powers of 2, >= 16
        from localllm.kernels.recurrent.triton_recurrent import chunk_scan_cuda

        return chunk_scan_cuda(qd, intra, u0, w, kd, e, state)
    return chunk_scan_ref(qd, intra, u0, w, kd, e, state)
