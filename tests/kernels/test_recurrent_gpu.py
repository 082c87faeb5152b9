"""The recurrent layers' Triton decode steps (`kernels/recurrent/triton_step.py`) against their
torch references (`causal_conv.causal_conv_step`, `ssd.ssd_step_ref`): outputs and the states
left behind, over several steps from a nonzero state, grouped heads, sizes off the blocks.
Marked `gpu` (or run on CPU under TRITON_INTERPRET=1 with triton installed)."""

import pytest
import torch
import torch.nn.functional as F

from localllm.kernels.recurrent.causal_conv import causal_conv_step
from localllm.kernels.recurrent.ssd import ssd_step_ref
from tests.triton_env import DEVICE, TRITON_MARKS

pytestmark = TRITON_MARKS
TOL = 1e-5  # float32 both, other summation orders


@pytest.mark.parametrize(("s", "c", "k"), [(1, 96, 4), (3, 300, 3), (4, 2048, 2)])
@pytest.mark.parametrize("bias_silu", [False, True])
def test_conv_step_matches_reference(s, c, k, bias_silu):
    from localllm.kernels.recurrent.triton_step import conv_step_triton

    gen = torch.Generator().manual_seed(c + k)
    w = torch.randn(c, k, generator=gen) / k**0.5
    bias = 0.5 * torch.randn(c, generator=gen) if bias_silu else None
    state = torch.randn(s, k - 1, c, generator=gen)
    ref_state, got_state = state.clone(), state.clone().to(DEVICE)
    for step in range(3):
        x = torch.randn(s, c, generator=gen)
        want = causal_conv_step(x, w, ref_state, silu=False)
        if bias_silu:
            want = F.silu(want + bias)
        dev = None if bias is None else bias.to(DEVICE)
        got = conv_step_triton(x.to(DEVICE), w.to(DEVICE), got_state, dev, silu=bias_silu)
        assert (got.cpu() - want).abs().max() < TOL, step
        assert (got_state.cpu() - ref_state).abs().max() == 0, step  # moved, not computed


@pytest.mark.parametrize(
    ("s", "h", "p", "g", "n"), [(1, 4, 16, 2, 8), (3, 48, 64, 1, 128), (2, 6, 20, 3, 12)]
)
def test_ssd_step_matches_reference(s, h, p, g, n):
    from localllm.kernels.recurrent.triton_step import ssd_step_triton

    gen = torch.Generator().manual_seed(h * p)
    a = -torch.rand(h, generator=gen) * 4 - 0.1
    state = 0.5 * torch.randn(s, h, p, n, generator=gen)
    ref_state, got_state = state.clone(), state.clone().to(DEVICE)
    for step in range(3):
        x = torch.randn(s, h, p, generator=gen)
        dt = F.softplus(torch.randn(s, h, generator=gen))
        b, c = torch.randn(s, g, n, generator=gen), torch.randn(s, g, n, generator=gen)
        want = ssd_step_ref(x, dt, a, b, c, ref_state)
        args = (t.to(DEVICE) for t in (x, dt, a, b, c))
        got = ssd_step_triton(*args, got_state)
        assert (got.cpu() - want).abs().max() < TOL * 10, step
        assert (got_state.cpu() - ref_state).abs().max() < TOL, step


@pytest.mark.parametrize("name", ["lfm2", "granitehybrid"])
def test_fixture_decodes_through_the_triton_steps(name, monkeypatch):
    """The converted fixtures decoded token by token with the Triton steps in the model (the
    layers' wiring: rows, slots, bias and SiLU): transformers' logits, as the torch path gives."""
    import localllm.engine.layers.recurrent as layers
    import localllm.kernels.recurrent.ssd as ssd
    from localllm.engine.core.batch import BatchMeta
    from localllm.engine.gguf import open_gguf
    from localllm.engine.loader import build_model
    from localllm.engine.runtime.kv_cache import PagedKVCache
    from localllm.engine.runtime.recurrent_state import attach_states
    from tests.engine.family_goldens import golden_logits, path, sequence

    monkeypatch.setattr(layers, "use_triton", lambda x: True)
    monkeypatch.setattr(ssd, "use_triton", lambda s: True)
    ids = sequence(name)
    with open_gguf(path(name)) as g, torch.inference_mode():
        model = build_model(g, precise=True, device=DEVICE)
        layers_, heads, dim = model.kv_shape()
        kv = PagedKVCache(layers_, len(ids), 4, heads, dim, "f32", DEVICE)
        attach_states(kv, model, 2)
        rows = []
        for t, tok in enumerate(ids):
            batch = BatchMeta.contiguous(1, t + 1, 4)
            batch = BatchMeta(batch.query_start, batch.seq_lens, batch.block_tables,
                              batch.slot_mapping.to(DEVICE), 4, state_slots=(1,))  # fmt: skip
            ids_t = torch.tensor([tok], device=DEVICE)
            pos = torch.tensor([t], device=DEVICE)
            rows.append(model.logits(model(ids_t, pos, batch, kv)).float().cpu())
    # CPU (interpreted): only the steps differ from the precise torch path; CUDA: its attention
    # and matmul kernels sum in other orders too
    tol = 2e-3 if DEVICE == "cuda" else 1e-4
    assert (torch.cat(rows) - golden_logits(name)).abs().max() < tol
