"""`kernels/cpu/recurrent_step.c` against the torch references of `kernels/recurrent/decode.py`:
Mamba-2's scan step, Gated DeltaNet's delta rule and the causal short conv on state slots, in
place."""

import pytest
import torch

from localllm.kernels.cpu import recurrent_step
from localllm.kernels.cpu.cbuild import compiler
from localllm.kernels.recurrent import decode
from localllm.kernels.recurrent.ssd import Mamba2Mixer

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler")
RS = recurrent_step.load() if compiler() else None


def test_the_kernels_build_and_pass_their_self_check():
    """With a compiler the library loads (a kernel failing its self-check would leave every
    other test here comparing nothing)."""
    assert RS is not None


@pytest.mark.parametrize("b,h,p,n,g", [(1, 48, 64, 128, 1), (3, 8, 16, 32, 2), (5, 6, 7, 9, 3)])
def test_ssd_step_matches_reference(b, h, p, n, g):
    gen = torch.Generator().manual_seed(b * 100 + h)
    slots = torch.randperm(b + 2, generator=gen)[:b]
    fresh = torch.rand(b, generator=gen) < 0.4
    st = torch.randn(b + 2, h, p, n, generator=gen)
    st[slots[fresh]] = float("nan")  # a fresh slot's bytes are never read
    x, dt = torch.randn(b, h, p, generator=gen), torch.rand(b, h, generator=gen)
    A = -torch.rand(h, generator=gen) * 4
    B, C = torch.randn(b, g, n, generator=gen), torch.randn(b, g, n, generator=gen)
    ref_st = st.clone()
    want = decode.ssd_decode_ref(x, dt, A, B, C, ref_st, slots, fresh)
    got = RS.ssd(x, dt, A, B, C, st, slots, fresh)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st, ref_st, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize(
    "b,hk,hv,dk,dv", [(1, 16, 32, 128, 128), (3, 2, 4, 16, 8), (4, 3, 3, 5, 7)]
)
def test_gated_delta_step_matches_reference(b, hk, hv, dk, dv):
    gen = torch.Generator().manual_seed(b * 10 + hv)
    slots = torch.randperm(b + 1, generator=gen)[:b]
    fresh = torch.rand(b, generator=gen) < 0.4
    st = torch.randn(b + 1, hv, dk, dv, generator=gen) * 0.1
    st[slots[fresh]] = float("nan")
    q, k = torch.randn(b, hk, dk, generator=gen), torch.randn(b, hk, dk, generator=gen)
    v = torch.randn(b, hv, dv, generator=gen)
    g, beta = -torch.rand(b, hv, generator=gen), torch.rand(b, hv, generator=gen)
    ref_st = st.clone()
    want = decode.gated_delta_decode_ref(q, k, v, g, beta, ref_st, slots, fresh, 1e-6)
    got = decode.gated_delta_decode(q, k, v, g, beta, st, slots, fresh, 1e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st, ref_st, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_ssd_decode_dispatches_to_the_kernel_and_leaves_other_slots():
    """`decode.ssd_decode` on CPU float32 runs the kernel (the reference's answer, in place);
    slots no row names keep their bytes exactly."""
    gen = torch.Generator().manual_seed(7)
    st = torch.randn(6, 4, 8, 16, generator=gen)
    before = st.clone()
    slots, fresh = torch.tensor([4, 1]), torch.tensor([False, False])
    x, dt = torch.randn(2, 4, 8, generator=gen), torch.rand(2, 4, generator=gen)
    A, B = -torch.rand(4, generator=gen), torch.randn(2, 1, 16, generator=gen)
    C = torch.randn(2, 1, 16, generator=gen)
    ref_st = st.clone()
    want = decode.ssd_decode_ref(x, dt, A, B, C, ref_st, slots, fresh)
    got = decode.ssd_decode(x, dt, A, B, C, st, slots, fresh)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for s in (0, 2, 3, 5):
        assert torch.equal(st[s], before[s])
    assert not torch.equal(st[4], before[4])


def test_unsupported_inputs_answer_none():
    """Tensors the kernel does not read (a float64 state, a non-contiguous one, groups that do
    not divide the heads) fall back: the kernel answers None and touches nothing."""
    x, dt, A = torch.randn(1, 6, 4), torch.rand(1, 6), -torch.rand(6)
    B = C = torch.randn(1, 4, 8)  # 4 groups for 6 heads
    st = torch.randn(2, 6, 4, 8)
    slots, fresh = torch.tensor([1]), torch.tensor([False])
    assert RS.ssd(x, dt, A, B, C, st, slots, fresh) is None
    B = C = torch.randn(1, 2, 8)
    assert RS.ssd(x, dt, A, B, C, st.double(), slots, fresh) is None
    strided = torch.randn(2, 6, 8, 4).transpose(2, 3)  # [2, 6, 4, 8], not contiguous
    assert RS.ssd(x, dt, A, B, C, strided, slots, fresh) is None
    before = st.clone()
    assert RS.ssd(x, dt, A, B, C, st, slots, fresh) is not None
    assert not torch.equal(st[1], before[1]) and torch.equal(st[0], before[0])


@pytest.mark.parametrize("bias,silu", [(True, True), (False, False), (False, True)])
@pytest.mark.parametrize("b,c,taps", [(1, 3328, 4), (3, 20, 3), (2, 600, 2)])
def test_conv_step_matches_reference(b, c, taps, bias, silu):
    """Mamba-2's conv (bias, SiLU), LFM2's (neither) and Qwen3-Next's (SiLU alone), through the
    dispatching functions the layers call."""
    gen = torch.Generator().manual_seed(b * 7 + c + taps)
    slots = torch.randperm(b + 2, generator=gen)[:b]
    fresh = torch.rand(b, generator=gen) < 0.4
    st = torch.randn(b + 2, taps - 1, c, generator=gen)
    st[slots[fresh]] = float("nan")
    x, w = torch.randn(b, c, generator=gen), torch.randn(c, taps, generator=gen)
    bb = torch.randn(c, generator=gen) if bias else None
    ref_st = st.clone()
    want = decode.short_conv_decode_ref(x, w, ref_st, slots, fresh, bb, silu)
    if bias or not silu:
        got = decode.short_conv_decode(x, w, st, slots, fresh, bb, silu)
    else:
        got = decode.conv_decode(x, w, st, slots, fresh)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st, ref_st, rtol=1e-5, atol=1e-5, equal_nan=True)


def _mixer_inputs(b, h, p, n, g, taps, bias, seed):
    """A Mamba-2 mixer step's arguments on b rows over b + 2 slots, some fresh (NaN slots)."""
    gen = torch.Generator().manual_seed(seed)
    din, cc = h * p, h * p + 2 * g * n
    slots = torch.randperm(b + 2, generator=gen)[:b]
    fresh = torch.rand(b, generator=gen) < 0.4
    conv_st = torch.randn(b + 2, taps - 1, cc, generator=gen)
    ssm_st = torch.randn(b + 2, h, p, n, generator=gen) * 0.5
    conv_st[slots[fresh]], ssm_st[slots[fresh]] = float("nan"), float("nan")
    zxd = torch.randn(b, din + cc + h, generator=gen)
    conv_w = torch.randn(cc, taps, generator=gen) * 0.5
    conv_b = torch.randn(cc, generator=gen) if bias else None
    dt_bias, A = torch.randn(h, generator=gen), -torch.rand(h, generator=gen) * 4
    D, norm_w = torch.randn(h, generator=gen), torch.randn(din, generator=gen)
    m = Mamba2Mixer(conv_w, conv_b, dt_bias, A, D, norm_w, 1e-5, h, g)
    return zxd, m, conv_st, ssm_st, slots, fresh


@pytest.mark.parametrize(
    "b,h,p,n,g,taps,bias",
    [(1, 48, 64, 128, 1, 4, True), (3, 8, 16, 32, 2, 4, True), (4, 6, 5, 9, 3, 3, False)],
)
def test_mamba2_mixer_step_matches_reference(b, h, p, n, g, taps, bias):
    """The whole mixer (conv, softplus(dt + bias), scan, D skip, SiLU(z) gate, group norm) in one
    call equals the references composed (`decode.mamba2_mixer_decode_ref`), output and both
    states; the first shape is Granite-4.0-H-Tiny's."""
    zxd, m, conv_st, ssm_st, slots, fresh = _mixer_inputs(b, h, p, n, g, taps, bias, b * 7 + h)
    ref_c, ref_s = conv_st.clone(), ssm_st.clone()
    want = decode.mamba2_mixer_decode_ref(zxd, m, ref_c, ref_s, slots, fresh)
    got = decode.mamba2_mixer_decode(zxd, m, conv_st, ssm_st, slots, fresh)
    assert got is not None
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(conv_st, ref_c, rtol=1e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(ssm_st, ref_s, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_mamba2_mixer_leaves_other_slots_and_refuses_odd_shapes():
    """Slots no row names keep their bytes; a width that is not Din + Cc + H, or heads the
    state does not have, answer None with the states untouched."""
    zxd, m, conv_st, ssm_st, slots, fresh = _mixer_inputs(2, 4, 8, 16, 2, 4, True, 3)
    before_c, before_s = conv_st.clone(), ssm_st.clone()
    assert RS.mamba2(zxd[:, :-1], m, conv_st, ssm_st, slots, fresh) is None
    assert RS.mamba2(zxd, m._replace(heads=5), conv_st, ssm_st, slots, fresh) is None
    assert torch.equal(conv_st.nan_to_num(), before_c.nan_to_num())
    assert torch.equal(ssm_st.nan_to_num(), before_s.nan_to_num())
    assert RS.mamba2(zxd, m, conv_st, ssm_st, slots, fresh) is not None
    for s in set(range(4)) - set(slots.tolist()):
        assert torch.equal(conv_st[s].nan_to_num(), before_c[s].nan_to_num())
        assert torch.equal(ssm_st[s].nan_to_num(), before_s[s].nan_to_num())
