"""A decode step of the recurrent layers straight on the state slots: each of B sequences' one new
token updates its slot in place (`slots` [B] int64; `fresh` [B] bool: the sequence starts here,
its slot's old contents are never read). Plain-torch references; on CUDA float32 tensors one
triton launch each (`triton_recurrent`; LFM2's and Mamba-2's steps, `short_conv_decode_ref` and
`ssd_decode_ref`, are `triton_step`'s kernels given the slots, called by `engine.layers.recurrent`);
on a CPU `ssd_decode`, `short_conv_decode`, `conv_decode` and `gated_delta_decode` run
`kernels/cpu/recurrent_step.c` in place on the slots where it builds (the references otherwise).

`gated_delta_decode` also takes q and k raw (before their L2 norm, per key head) and does what
Gated DeltaNet does before the rule: normalise q and k, scale q by 1/sqrt(Dk), let key head
h // (Hv / Hk) serve value head h. `conv_decode` is the causal short conv's step with SiLU.
"""

import torch
import torch.nn.functional as F

from localllm.kernels.recurrent.causal_conv import causal_conv_step
from localllm.kernels.recurrent.delta_rule import delta_rule_step_ref, l2_normalize
from localllm.kernels.recurrent.ssd import Mamba2Mixer, ssd_step_ref


def _cuda32(*xs: torch.Tensor) -> bool:
    return all(x.is_cuda and x.dtype == torch.float32 for x in xs)


def _read(states: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    got = states.index_select(0, slots)
    keep = ~fresh.view(-1, *([1] * (states.dim() - 1)))
    return torch.where(keep, got, torch.zeros((), dtype=got.dtype, device=got.device))


def gated_delta_decode_ref(q, k, v, g, beta, states, slots, fresh, eps: float) -> torch.Tensor:
    """q, k [B, Hk, Dk] raw, v [B, Hv, Dv], g and beta [B, Hv]; states [S, Hv, Dk, Dv] float32,
    the sequences' slots updated in place. Returns o [B, Hv, Dv] float32."""
    rep = v.shape[1] // q.shape[1]
    qn = l2_normalize(q, eps).repeat_interleave(rep, dim=1) * q.shape[-1] ** -0.5
    kn = l2_normalize(k, eps).repeat_interleave(rep, dim=1)
    s = _read(states, slots, fresh)
    o = delta_rule_step_ref(qn, kn, v, g, beta, s)
    states.index_copy_(0, slots, s)
    return o


def gated_delta_decode(q, k, v, g, beta, states, slots, fresh, eps: float) -> torch.Tensor:
    """`gated_delta_decode_ref`, by one triton launch on CUDA; on a CPU the rule by
    `kernels/cpu/recurrent_step.c` (the state in place) where it builds."""
    if _cuda32(states):
        from localllm.kernels.recurrent.triton_recurrent import gated_delta_decode_cuda

        return gated_delta_decode_cuda(q, k, v, g, beta, states, slots, fresh, eps)
    rs = _native(states)
    if rs is not None:
        rep = v.shape[1] // q.shape[1]
        qn = l2_normalize(q, eps).repeat_interleave(rep, dim=1) * q.shape[-1] ** -0.5
        kn = l2_normalize(k, eps).repeat_interleave(rep, dim=1)
        o = rs.delta(qn, kn, v, g, beta, states, slots, fresh)
        if o is not None:
            return o
    return gated_delta_decode_ref(q, k, v, g, beta, states, slots, fresh, eps)


def gated_delta_raw_ref(q, k, v, ba, dt_bias, ssm_a, states, slots, fresh, eps: float):
    """`gated_delta_decode_ref` with g and beta from Qwen3-Next's projection row ba [B, 2 * Hv]
    (per key head: b, then a, for its value heads): beta = sigmoid(b), g = ssm_a * softplus(a +
    dt_bias)."""
    bsz, hk, hv = q.shape[0], q.shape[1], v.shape[1]
    ba = ba.float().view(bsz, hk, 2, hv // hk)
    beta = torch.sigmoid(ba[:, :, 0].reshape(bsz, hv))
    g = ssm_a * F.softplus(ba[:, :, 1].reshape(bsz, hv) + dt_bias)
    return gated_delta_decode_ref(q, k, v, g, beta, states, slots, fresh, eps)


def gated_delta_raw(q, k, v, ba, dt_bias, ssm_a, states, slots, fresh, eps: float):
    """`gated_delta_raw_ref`, by one triton launch on CUDA (g and beta made in the kernel)."""
    if _cuda32(states):
        from localllm.kernels.recurrent.triton_recurrent import gated_delta_decode_cuda

        raw = (ba, dt_bias, ssm_a)
        return gated_delta_decode_cuda(q, k, v, None, None, states, slots, fresh, eps, raw)
    return gated_delta_raw_ref(q, k, v, ba, dt_bias, ssm_a, states, slots, fresh, eps)


def norm_gate_ref(o, z, weight, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """Qwen3-Next's gated norm: RMSNorm of each head's output o [T, H, D] (weight [D]) times
    SiLU(z) [T, H * D] -> [T, H * D] in `dtype`."""
    t, h, d = o.shape
    y = F.rms_norm(o.float(), (d,), weight.float(), eps)
    return (y * F.silu(z.float().view(t, h, d))).reshape(t, h * d).to(dtype)


def norm_gate(o, z, weight, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """`norm_gate_ref`, by one triton launch on CUDA."""
    if _cuda32(o):
        from localllm.kernels.recurrent.triton_recurrent import norm_gate_cuda

        return norm_gate_cuda(o, z, weight, eps, dtype)
    return norm_gate_ref(o, z, weight, eps, dtype)


def norm_gate_q(o, z, weight, eps: float, dtype: torch.dtype, quant: bool):
    """(`norm_gate`, its int8 rows for the out-projection's GEMV or None): one launch on CUDA."""
    if _cuda32(o):
        from localllm.kernels.recurrent.triton_recurrent import norm_gate_cuda

        if quant:
            return norm_gate_cuda(o, z, weight, eps, dtype, quant=True)
        return norm_gate_cuda(o, z, weight, eps, dtype), None
    return norm_gate_ref(o, z, weight, eps, dtype), None


def conv_decode_ref(x, weight, states, slots, fresh) -> torch.Tensor:
    """x [B, C], weight [C, K], states [S, K - 1, C] float32 updated in place; SiLU(conv) [B, C]."""
    s = _read(states, slots, fresh)
    y = causal_conv_step(x, weight, s, silu=False)
    states.index_copy_(0, slots, s)
    return F.silu(y)


def conv_decode(x, weight, states, slots, fresh) -> torch.Tensor:
    """`conv_decode_ref`, by one triton launch on CUDA; on a CPU by `recurrent_step.c`."""
    if _cuda32(states):
        from localllm.kernels.recurrent.triton_recurrent import conv_decode_cuda

        return conv_decode_cuda(x, weight, states, slots, fresh)
    rs = _native(states)
    y = None if rs is None else rs.conv(x, weight, states, slots, fresh, None, True)
    return conv_decode_ref(x, weight, states, slots, fresh) if y is None else y


def short_conv_decode_ref(x, weight, states, slots, fresh, bias=None, silu: bool = False):
    """The plain short conv's step (LFM2's; Mamba-2's with `bias` and `silu`): x [B, C], weight
    [C, K], states [S, K - 1, C] float32 updated in place -> [B, C] float32 (+ bias, then SiLU
    when `silu`)."""
    s = _read(states, slots, fresh)
    y = causal_conv_step(x, weight, s, silu=False)
    states.index_copy_(0, slots, s)
    if bias is not None:
        y = y + bias
    return F.silu(y) if silu else y


def ssd_decode_ref(x, dt, A, B, C, states, slots, fresh) -> torch.Tensor:
    """The Mamba-2 scan's step (`ssd.ssd_step_ref`) on the slots: x [B, H, P], dt [B, H], A [H],
    B and C [B, G, N], states [S, H, P, N] float32 updated in place -> y [B, H, P] float32."""
    s = _read(states, slots, fresh)
    y = ssd_step_ref(x, dt, A, B, C, s)
    states.index_copy_(0, slots, s)
    return y


def short_conv_decode(x, weight, states, slots, fresh, bias=None, silu: bool = False):
    """`short_conv_decode_ref`; on a CPU by `kernels/cpu/recurrent_step.c` where it builds."""
    rs = _native(states)
    y = None if rs is None else rs.conv(x, weight, states, slots, fresh, bias, silu)
    return short_conv_decode_ref(x, weight, states, slots, fresh, bias, silu) if y is None else y


def ssd_decode(x, dt, A, B, C, states, slots, fresh) -> torch.Tensor:
    """`ssd_decode_ref`; on a CPU by `kernels/cpu/recurrent_step.c` (one pass over the state)
    where it builds."""
    rs = _native(states)
    y = None if rs is None else rs.ssd(x, dt, A, B, C, states, slots, fresh)
    return ssd_decode_ref(x, dt, A, B, C, states, slots, fresh) if y is None else y


def mamba2_mixer_decode_ref(zxd, m: Mamba2Mixer, conv_states, ssm_states, slots, fresh):
    """Mamba-2's mixer between its projections for one token a sequence: zxd [B, Din + Cc + H]
    the in-projection's rows (z | x B C | dt; Din = H P, Cc = Din + 2 G N), `m` the layer's
    weights, conv_states [S, K - 1, Cc] and ssm_states [S, H, P, N] float32 updated in place.
    Returns the gated, group-normed scan output [B, Din] float32 (the out-projection's input):
    the conv, softplus(dt + dt_bias), the scan, then `gated_norm.skip_gate_norm_ref`."""
    from localllm.kernels.recurrent.gated_norm import skip_gate_norm_ref

    b = zxd.shape[0]
    h, p, n = ssm_states.shape[1:]
    din, cc, g = h * p, m.conv_w.shape[0], m.groups
    z, xbc, dt = zxd.float().split([din, cc, h], dim=-1)
    xbc = short_conv_decode_ref(xbc, m.conv_w, conv_states, slots, fresh, m.conv_b, silu=True)
    x, bm, cm = xbc.split([din, g * n, g * n], dim=-1)
    x = x.reshape(b, h, p)
    dt = F.softplus(dt + m.dt_bias)
    bm, cm = bm.reshape(b, g, n), cm.reshape(b, g, n)
    y = ssd_decode_ref(x, dt, m.A, bm, cm, ssm_states, slots, fresh)
    return skip_gate_norm_ref(y, x, m.D, z, m.norm_w.reshape(g, din // g), m.eps, torch.float32)


def mamba2_mixer_decode(zxd, m: Mamba2Mixer, conv_states, ssm_states, slots, fresh):
    """`mamba2_mixer_decode_ref`; on a CPU one call of `recurrent_step.c` where it builds and
    takes the tensors, else None (the caller runs its own ops: on CUDA, triton launches)."""
    rs = _native(conv_states)
    return None if rs is None else rs.mamba2(zxd, m, conv_states, ssm_states, slots, fresh)


def _native(states: torch.Tensor):
    if states.device.type != "cpu":
        return None
    from localllm.kernels.cpu import recurrent_step  # (compiled at first use)

    return recurrent_step.load()
