"""The triton decode steps of the recurrent layers (`kernels/recurrent/triton_recurrent.py`)
against their torch references (`decode.py`), on CUDA (marked gpu) or on CPU tensors under
TRITON_INTERPRET=1 with triton installed: outputs and the slots' new state, other slots
untouched, a fresh sequence's garbage never read."""

import pytest
import torch

from localllm.kernels.recurrent.decode import (
    conv_decode_ref,
    gated_delta_decode_ref,
    gated_delta_raw_ref,
    norm_gate_ref,
)
from tests.kernels.int8_rows import assert_int8_rows_of
from tests.kernels.test_recurrent_decode import EPS, SHAPES, TOL, conv_inputs, delta_inputs
from tests.triton_env import DEVICE, TRITON_MARKS

pytestmark = TRITON_MARKS


@pytest.mark.parametrize("shape", SHAPES)
def test_delta_decode_matches_reference(shape):
    from localllm.kernels.recurrent.triton_recurrent import gated_delta_decode_cuda

    args = delta_inputs(*shape, device=DEVICE, seed=2)
    ref_states = args[5].clone()
    want = gated_delta_decode_ref(*args[:5], ref_states, *args[6:], EPS)
    got = gated_delta_decode_cuda(*args, EPS)
    assert (got - want).abs().max().item() < TOL
    assert torch.allclose(args[5], ref_states, atol=TOL, rtol=0, equal_nan=True)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("strided", [False, True])
def test_delta_decode_from_the_projection_row_matches_reference(shape, strided):
    """g and beta made in the kernel from Qwen3-Next's ssm_ba row (b, then a, per key head; a
    view into a wider projection output when `strided`), softplus past its threshold too."""
    from localllm.kernels.recurrent.triton_recurrent import gated_delta_decode_cuda

    q, k, v, _, _, states, slots, fresh = delta_inputs(*shape, device=DEVICE, seed=4)
    hv = shape[1]
    gen = torch.Generator().manual_seed(7)
    wide = 3 * torch.randn(3, 2 * hv + 5, generator=gen)
    wide[0, 2 + 2 * hv - 1] = 25.0  # an `a` past softplus's threshold of 20
    ba = wide[:, 2 : 2 + 2 * hv] if strided else wide[:, : 2 * hv].contiguous()
    dt, a = torch.randn(hv, generator=gen), -torch.rand(hv, generator=gen) - 0.1
    ref_states = states.clone()
    want = gated_delta_raw_ref(q, k, v, ba.to(DEVICE), dt.to(DEVICE), a.to(DEVICE), ref_states,
                               slots, fresh, EPS)  # fmt: skip
    raw = (ba.to(DEVICE), dt.to(DEVICE), a.to(DEVICE))
    got = gated_delta_decode_cuda(q, k, v, None, None, states, slots, fresh, EPS, raw)
    assert (got - want).abs().max().item() < TOL
    assert torch.allclose(states, ref_states, atol=TOL, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("h", "d"), [(4, 128), (3, 40)])
def test_norm_gate_matches_reference(h, d, dtype):
    """Qwen3-Next's gated norm in one launch: RMSNorm per head times SiLU(z), z a view into a
    wider projection output (its row stride)."""
    from localllm.kernels.recurrent.triton_recurrent import norm_gate_cuda

    gen = torch.Generator().manual_seed(h * d)
    o = torch.randn(5, h, d, generator=gen)
    wide = torch.randn(5, h * d + 7, generator=gen)
    z, w = wide[:, 3 : 3 + h * d], 1 + 0.1 * torch.randn(d, generator=gen)
    want = norm_gate_ref(o, z, w, EPS, dtype)
    got = norm_gate_cuda(o.to(DEVICE), z.to(DEVICE), w.to(DEVICE), EPS, dtype)
    assert got.dtype == dtype
    tol = TOL if dtype == torch.float32 else 2e-3 * want.abs().max().item()
    assert (got.cpu().float() - want.float()).abs().max().item() < tol


@pytest.mark.parametrize(("h", "d"), [(32, 128), (3, 96), (3, 40)])
def test_norm_gate_writes_the_out_projections_int8_rows(h, d):
    """`qwen3next.FUSED_NORMS`: with `quant` the same output and its int8 rows exactly what
    `quantize_x8` makes of it (heads past the first at their offsets; 96: a head off the power
    of two); none where D is no multiple of 32 (40) or the output not float32."""
    from localllm.kernels.recurrent.triton_recurrent import norm_gate_cuda

    gen = torch.Generator().manual_seed(h * d + 1)
    o = torch.randn(3, h, d, generator=gen).to(DEVICE)
    wide = torch.randn(3, h * d + 7, generator=gen).to(DEVICE)
    z, w = wide[:, 3 : 3 + h * d], (1 + 0.1 * torch.randn(d, generator=gen)).to(DEVICE)
    got, xq = norm_gate_cuda(o, z, w, EPS, torch.float32, quant=True)
    assert torch.equal(got, norm_gate_cuda(o, z, w, EPS, torch.float32))
    if d % 32:
        assert xq is None
        return
    assert_int8_rows_of(xq, got)
    assert norm_gate_cuda(o, z, w, EPS, torch.float16, quant=True)[1] is None


@pytest.mark.parametrize(("c", "kk"), [(40, 4), (300, 4), (64, 2)])
def test_conv_decode_matches_reference(c, kk):
    from localllm.kernels.recurrent.triton_recurrent import conv_decode_cuda

    x, w, states, slots, fresh = conv_inputs(c, kk, device=DEVICE, seed=3)
    ref_states = states.clone()
    want = conv_decode_ref(x, w, ref_states, slots, fresh)
    got = conv_decode_cuda(x, w, states, slots, fresh)
    assert (got - want).abs().max().item() < TOL
    assert torch.allclose(states, ref_states, atol=TOL, rtol=0, equal_nan=True)


@pytest.mark.parametrize("fused", [False, True, "norms"])
def test_qwen3next_on_the_kernels_matches_transformers(fused, monkeypatch):
    """The converted Qwen3-Next fixture run with these kernels on its state slots (forced on CPU
    tensors under the interpreter): prompt chunks of 7 and 5 tokens (the chunked rule's scan
    between blocks), then decode steps (conv and rule steps); transformers' fp32 logits. The
    fixture's F16 linears take float32 activations (`HALF_GEMM` off: half ones alone move the
    logits 0.096 through the recurrent state, H100, 2026-12-07). `fused`: the decode steps as
    `qwen3next.FUSED_DECODE` runs them (one input linear, g and beta in the rule's launch, the
    gated norm's launch); "norms": with `qwen3next.FUSED_NORMS` too (its wiring; the int8 rows
    and the fused ends need CUDA tensors, tested in their kernels' tests)."""
    from localllm.engine.models import qwen3next
    from localllm.kernels.quant import linear

    monkeypatch.setattr(linear, "HALF_GEMM", False)
    monkeypatch.setattr(qwen3next, "FUSED_NORMS", fused == "norms")
    fused = bool(fused)
    monkeypatch.setattr(qwen3next, "FUSED_DECODE", fused)
    import dataclasses
    import itertools

    from localllm.engine.core.batch import BatchMeta
    from localllm.engine.gguf import open_gguf
    from localllm.engine.loader import build_model
    from localllm.engine.runtime.kv_cache import PagedKVCache
    from localllm.engine.runtime.recurrent_state import attach_states
    from localllm.kernels.recurrent import decode, delta_rule
    from tests.engine.family_goldens import golden_logits, path, sequence

    calls = []
    for mod in (decode, delta_rule):

        def forced(*xs, real=mod._cuda32):
            calls.append(1)
            return DEVICE == "cpu" or real(*xs)

        monkeypatch.setattr(mod, "_cuda32", forced)
    ids = sequence("qwen3next")[:24]
    bounds = [0, 7, 12, *range(13, len(ids) + 1)]
    with open_gguf(path("qwen3next")) as g:
        model = build_model(g, precise=DEVICE == "cpu", device=DEVICE)
        deltas = [b for b in model.blk if isinstance(b, qwen3next.DeltaNetBlock)]
        if fused and DEVICE == "cpu":  # (fuse() fuses on CUDA only)
            model._native_step = False  # (the native CPU step reads the three linears)
            for b in deltas:
                b.fuse_inputs()
        assert all((b.in_fused is not None) == fused for b in deltas)
        layers, heads, hd = model.kv_shape()
        kv = PagedKVCache(layers, 6, 4, heads, hd, "f32", DEVICE)
        attach_states(kv, model, 3)
        rows = []
        with torch.inference_mode():
            for s, e in itertools.pairwise(bounds):
                batch = BatchMeta.contiguous(e - s, e, 4)
                batch = dataclasses.replace(batch, slot_mapping=batch.slot_mapping.to(DEVICE),
                                            state_slots=(2,))  # fmt: skip
                x = torch.tensor(ids[s:e], device=DEVICE)
                rows.append(model.logits(model(x, torch.arange(s, e, device=DEVICE), batch, kv)))
    assert len(calls) >= 3 * (2 + 2 * 12)  # 3 DeltaNet layers: 2 prompt chunks, 12 decode steps
    err = (torch.cat(rows).float().cpu() - golden_logits("qwen3next")[:24]).abs().max().item()
    assert err < (2e-4 if DEVICE == "cpu" else 2e-2), err


@pytest.mark.parametrize(
    ("t", "h", "dk", "dv"), [(150, 4, 8, 8), (70, 2, 128, 128), (64, 3, 24, 40)]
)
def test_chunk_scan_matches_reference(t, h, dk, dv):
    from localllm.kernels.recurrent.delta_rule import chunk_prepare, chunk_scan_ref
    from localllm.kernels.recurrent.triton_recurrent import chunk_scan_cuda
    from tests.kernels.test_delta_rule import inputs

    q, k, v, g, beta, s0 = (x.to(DEVICE) for x in inputs(t, h, dk, dv, seed=4))
    parts = chunk_prepare(q, k, v, g, beta)
    ref_state, state = s0.clone(), s0.clone()
    want = chunk_scan_ref(*parts, ref_state)
    got = chunk_scan_cuda(*parts, state)
    assert (got - want).abs().max().item() < TOL
    assert (state - ref_state).abs().max().item() < TOL
