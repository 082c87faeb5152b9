"""`recurrent_step.c`: the decode step of Mamba-2's scan, Gated DeltaNet's delta rule and the
causal short conv on the CPU, in place on each sequence's state slot (one pass over the state
where the torch references of `kernels/recurrent/decode.py` make five or six), compiled at first
use like `float_gemv.py`.

`load()` answers a `RecurrentStep`, or None where no compiler or a failed self-check (each kernel
against its reference on random slots, fresh and not) leaves callers on the references. Its
calls take exactly what the references take and answer None where the tensors are not what the
kernels read (not CPU float32 contiguous, groups that do not divide the heads): then the
reference runs.
"""

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from localllm.kernels.cpu.cbuild import built_libraries

SOURCE = Path(__file__).with_name("recurrent_step.c")
HEADER = Path(__file__).with_name("recurrent_rows.h")  # included by SOURCE: part of the key
FLAG_SETS = (("-O3", "-march=native", "-fopenmp"), ("-O3", "-fopenmp"), ("-O3",))
CHECK_TOL = 1e-5  # relative, outputs and states: float32 sums in another order
_P, _I, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def _inputs(states, slots, fresh, *ts: torch.Tensor | None):
    """(slots int64, fresh uint8, the tensors as contiguous float32, None kept) as the kernels
    read them, or None where the state is not CPU float32 contiguous or a tensor is elsewhere."""
    if states.dtype != torch.float32 or not states.is_contiguous() or states.device.type != "cpu":
        return None
    if any(t is not None and t.device.type != "cpu" for t in ts):
        return None
    got = [None if t is None else t.float().contiguous() for t in ts]
    return slots.to(torch.int64).contiguous(), fresh.to(torch.uint8).contiguous(), got


@dataclass(frozen=True)
class RecurrentStep:
    lib: ctypes.CDLL
    path: Path

    def ssd(self, x, dt, A, B, C, states, slots, fresh) -> torch.Tensor | None:
        """`decode.ssd_decode_ref`'s step: x [b, H, P], dt [b, H], A [H], B and C [b, G, N],
        states [S, H, P, N] float32 (the rows' slots updated in place) -> y [b, H, P]."""
        sl = _inputs(states, slots, fresh, x, dt, A, B, C)
        if sl is None:
            return None
        x, dt, A, B, C = sl[2]
        b, h, p = x.shape
        g, n = B.shape[1:]
        if h % g or tuple(states.shape[1:]) != (h, p, n) or tuple(C.shape) != (b, g, n):
            return None
        y = torch.empty(b, h, p)
        ptr = torch.Tensor.data_ptr
        self.lib.ssd_step_slots(b, ptr(x), ptr(dt), ptr(A), ptr(B), ptr(C), ptr(states),
                                ptr(sl[0]), ptr(sl[1]), h, p, n, g, ptr(y),
                                torch.get_num_threads())  # fmt: skip
        return y

    def conv(self, x, weight, states, slots, fresh, bias=None, silu=False) -> torch.Tensor | None:
        """`decode.short_conv_decode_ref`'s step: x [b, C], weight [C, K], states [S, K - 1, C]
        float32 (updated in place), bias [C] or None -> y [b, C] (SiLU'd where `silu`)."""
        sl = _inputs(states, slots, fresh, x, weight, bias)
        if sl is None:
            return None
        x, weight, bias = sl[2]
        b, c = x.shape
        taps = weight.shape[-1]
        if weight.dim() != 2 or weight.shape[0] != c or taps < 2:
            return None
        if tuple(states.shape[1:]) != (taps - 1, c) or (bias is not None and bias.numel() != c):
            return None
        y = torch.empty(b, c)
        ptr = torch.Tensor.data_ptr
        self.lib.conv_step_slots(b, ptr(x), ptr(weight), taps, ptr(states), ptr(sl[0]),
                                 ptr(sl[1]), None if bias is None else ptr(bias), int(silu), c,
                                 ptr(y), torch.get_num_threads())  # fmt: skip
        return y

    def mamba2(self, zxd, m, conv_states, ssm_states, slots, fresh) -> torch.Tensor | None:
        """`decode.mamba2_mixer_decode_ref`: zxd [b, Din + Cc + H] the in-projection's rows, `m`
        a `ssd.Mamba2Mixer`, conv_states [S, K - 1, Cc] and ssm_states [S, H, P, N] float32
        (updated in place) -> [b, Din], the out-projection's input."""
        if conv_states.dtype != torch.float32 or not conv_states.is_contiguous():
            return None
        sl = _inputs(ssm_states, slots, fresh, zxd, m.conv_w, m.conv_b, m.dt_bias, m.A, m.D,
                     m.norm_w)  # fmt: skip
        if sl is None:
            return None
        zxd, conv_w, conv_b, dt_bias, A, D, norm_w = sl[2]
        groups = m.groups
        b, width = zxd.shape
        h, p, n = ssm_states.shape[1:]
        cc, taps = conv_w.shape
        din = h * p
        if h != m.heads or h % groups or din % groups or cc != din + 2 * groups * n:
            return None
        if width != din + cc + h or tuple(conv_states.shape[1:]) != (taps - 1, cc) or taps < 2:
            return None
        if norm_w.numel() != din or (conv_b is not None and conv_b.numel() != cc):
            return None
        xbc, out = torch.empty(b, cc), torch.empty(b, din)
        ptr = torch.Tensor.data_ptr
        self.lib.mamba2_step_slots(b, ptr(zxd), ptr(conv_w),
                                   None if conv_b is None else ptr(conv_b), taps,
                                   ptr(conv_states), ptr(dt_bias), ptr(A), ptr(D), ptr(norm_w),
                                   m.eps, ptr(ssm_states), ptr(sl[0]), ptr(sl[1]), h, p, n,
                                   groups, ptr(xbc), ptr(out), torch.get_num_threads())  # fmt: skip
        return out

    def delta(self, q, k, v, g, beta, states, slots, fresh) -> torch.Tensor | None:
        """`decode.gated_delta_decode_ref`'s rule after its normalization: q, k [b, H, K] (one
        per value head, q scaled), v [b, H, V], g and beta [b, H], states [S, H, K, V] float32
        (updated in place) -> o [b, H, V]."""
        sl = _inputs(states, slots, fresh, q, k, v, g, beta)
        if sl is None:
            return None
        q, k, v, g, beta = sl[2]
        b, h, kd = q.shape
        vd = v.shape[-1]
        if tuple(states.shape[1:]) != (h, kd, vd) or tuple(k.shape) != (b, h, kd):
            return None
        o = torch.empty(b, h, vd)
        threads = torch.get_num_threads()
        pred = torch.empty(threads * vd)
        ptr = torch.Tensor.data_ptr
        self.lib.delta_step_slots(b, ptr(q), ptr(k), ptr(v), ptr(g), ptr(beta), ptr(states),
                                  ptr(sl[0]), ptr(sl[1]), h, kd, vd, ptr(o), ptr(pred),
                                  threads)  # fmt: skip
        return o


def _bind(lib: ctypes.CDLL) -> None:
    lib.ssd_step_slots.argtypes = [_I, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _P, _INT]
    lib.ssd_step_slots.restype = None
    lib.delta_step_slots.argtypes = [_I, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _P, _P,
                                     _INT]  # fmt: skip
    lib.delta_step_slots.restype = None
    lib.conv_step_slots.argtypes = [_I, _P, _P, _I, _P, _P, _P, _P, _INT, _I, _P, _INT]
    lib.conv_step_slots.restype = None
    lib.mamba2_step_slots.argtypes = [_I, _P, _P, _P, _I, _P, _P, _P, _P, _P, ctypes.c_float, _P,
                                      _P, _P, _I, _I, _I, _I, _P, _P, _INT]  # fmt: skip
    lib.mamba2_step_slots.restype = None


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool((got - want).norm() <= CHECK_TOL * want.norm())


def self_check(rs: RecurrentStep, seed: int = 0) -> bool:
    """Every kernel against its reference: three rows on slots 3, 0, 2 of four, the middle one
    fresh (its slot filled with NaN, which must not be read), grouped B / C."""
    from localllm.kernels.recurrent.causal_conv import causal_conv_step
    from localllm.kernels.recurrent.delta_rule import delta_rule_step_ref
    from localllm.kernels.recurrent.ssd import ssd_step_ref

    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    slots, fresh = torch.tensor([3, 0, 2]), torch.tensor([False, True, False])
    keep = (~fresh).float()
    b, h, p, n, g = 3, 4, 8, 16, 2
    st = r(4, h, p, n)
    st[0] = float("nan")
    x, dt, A, B, C = r(b, h, p), r(b, h).abs(), -r(h).abs(), r(b, g, n), r(b, g, n)
    want_st = st[slots].nan_to_num() * keep[:, None, None, None]
    want = ssd_step_ref(x, dt, A, B, C, want_st)
    got = rs.ssd(x, dt, A, B, C, st, slots, fresh)
    if got is None or not (_close(got, want) and _close(st[slots], want_st)):
        return False
    k_, v_ = 8, 16
    st = r(4, h, k_, v_)
    st[0] = float("nan")
    q, k, v = r(b, h, k_), r(b, h, k_) / 3, r(b, h, v_)
    gg, beta = -r(b, h).abs(), torch.rand(b, h, generator=gen)
    want_st = st[slots].nan_to_num() * keep[:, None, None, None]
    want = delta_rule_step_ref(q, k, v, gg, beta, want_st)
    got = rs.delta(q, k, v, gg, beta, st, slots, fresh)
    if got is None or not (_close(got, want) and _close(st[slots], want_st)):
        return False
    st = r(4, 3, 20)
    st[0] = float("nan")
    x, w, bias = r(b, 20), r(20, 4), r(20)
    want_st = st[slots].nan_to_num() * keep[:, None, None]
    want = F.silu(causal_conv_step(x, w, want_st, silu=False) + bias)
    got = rs.conv(x, w, st, slots, fresh, bias, True)
    if got is None or not (_close(got, want) and _close(st[slots], want_st)):
        return False
    return _check_mamba2(rs, r, slots, fresh)


def _check_mamba2(rs: RecurrentStep, r, slots, fresh) -> bool:
    """The whole mixer against the references it fuses (`decode.mamba2_mixer_decode_ref`'s
    steps, here from the modules below it), grouped."""
    from localllm.kernels.recurrent.causal_conv import causal_conv_step
    from localllm.kernels.recurrent.gated_norm import skip_gate_norm_ref
    from localllm.kernels.recurrent.ssd import Mamba2Mixer, ssd_step_ref

    b, h, p, n, g, taps = 3, 4, 8, 16, 2, 4
    din, cc = h * p, h * p + 2 * g * n
    keep = (~fresh).float()
    conv_st, ssm_st = r(4, taps - 1, cc), r(4, h, p, n)
    conv_st[0], ssm_st[0] = float("nan"), float("nan")
    zxd, w, cb = r(b, din + cc + h), r(cc, taps), r(cc)
    dtb, A, D, nw = r(h), -r(h).abs(), r(h), r(din)
    want_c = conv_st[slots].nan_to_num() * keep[:, None, None]
    want_s = ssm_st[slots].nan_to_num() * keep[:, None, None, None]
    z, xbc, dt = zxd.split([din, cc, h], dim=-1)
    xbc = F.silu(causal_conv_step(xbc, w, want_c, silu=False) + cb)
    x, bm, cm = xbc.split([din, g * n, g * n], dim=-1)
    y = ssd_step_ref(x.reshape(b, h, p), F.softplus(dt + dtb), A, bm.reshape(b, g, n),
                     cm.reshape(b, g, n), want_s)  # fmt: skip
    want = skip_gate_norm_ref(y, x.reshape(b, h, p), D, z, nw.reshape(g, -1), 1e-5, torch.float32)
    m = Mamba2Mixer(w, cb, dtb, A, D, nw, 1e-5, h, g)
    got = rs.mamba2(zxd, m, conv_st, ssm_st, slots, fresh)
    return (
        got is not None
        and _close(got, want)
        and _close(conv_st[slots], want_c)
        and _close(ssm_st[slots], want_s)
    )


@functools.cache
def load(cache_dir: Path | None = None) -> RecurrentStep | None:
    """The compiled kernels, checked, or None (callers keep the references)."""
    sources = (SOURCE, HEADER)
    for lib, path, _ in built_libraries(sources, FLAG_SETS, "localllm-recurrent-step", _bind,
                                        cache_dir):  # fmt: skip
        rs = RecurrentStep(lib, path)
        if self_check(rs):
            return rs
    return None
