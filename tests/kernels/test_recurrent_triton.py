"""The triton decode steps of the recurrent layers (`kernels/recurrent/triton_recurrent.py`)
against their torch references (`decode.py`), on CUDA (marked gpu) or on CPU tensors under
TRITON_INTERPRET=1 with triton installed: outputs and the slots' new state, other slots
untouched, a fresh sequence's garbage never read."""

import pytest
import torch

from localllm.kernels.recurrent.decode import conv_decode_ref, gated_delta_decode_ref
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


@pytest.mark.parametrize(("c", "kk"), [(40, 4), (300, 4), (64, 2)])
def test_conv_decode_matches_reference(c, kk):
    from localllm.kernels.recurrent.triton_recurrent import conv_decode_cuda

    x, w, states, slots, fresh = conv_inputs(c, kk, device=DEVICE, seed=3)
    ref_states = states.clone()
    want = conv_decode_ref(x, w, ref_states, slots, fresh)
    got = conv_decode_cuda(x, w, states, slots, fresh)
    assert (got - want).abs().max().item() < TOL
    assert torch.allclose(states, ref_states, atol=TOL, rtol=0, equal_nan=True)


def test_qwen3next_on_the_kernels_matches_transformers(monkeypatch):
    """The converted Qwen3-Next fixture run with these kernels on its state slots (forced on CPU
    tensors under the interpreter): prompt chunks of 7 and 5 tokens (the chunked rule's scan
    between blocks), then decode steps (conv and rule steps); transformers' fp32 logits. The
    fixture's F16 linears take float32 activations (`HALF_GEMM` off: half ones alone move the
    logits 0.096 through the recurrent state, H100, 2026-12-07)."""
    from localllm.kernels.quant import linear

    monkeypatch.setattr(linear, "HALF_GEMM", False)
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
