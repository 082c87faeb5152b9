"""The recurrent layers' Triton decode steps (`kernels/recurrent/triton_step.py`) against their
torch references (`causal_conv.causal_conv_step`, `ssd.ssd_step_ref`): outputs and the states
left behind, over several steps from a nonzero state, grouped heads, sizes off the blocks.
Marked `gpu` (or run on CPU under TRITON_INTERPRET=1 with triton installed)."""

import pytest
import torch
import torch.nn.functional as F

from localllm.kernels.recurrent.causal_conv import causal_conv_step
from localllm.kernels.recurrent.ssd import ssd_step_ref
from tests.kernels.int8_rows import assert_int8_rows_of
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


SLOTS, FRESH = [3, 1, 0], [False, True, False]  # 3 sequences in 5 slots, the second fresh


def _slotted(state: torch.Tensor) -> torch.Tensor:
    """5 slots around a state of 3 sequences: theirs at SLOTS, NaN in the fresh one's (never
    read), something in the others (never touched)."""
    out = torch.full((5, *state.shape[1:]), 7.0)
    out[SLOTS] = state
    out[SLOTS[1]] = float("nan")
    return out


@pytest.mark.parametrize(("c", "k"), [(96, 4), (300, 3)])
@pytest.mark.parametrize("bias_silu", [False, True])
def test_conv_step_on_slots_matches_reference(c, k, bias_silu):
    """In place on the state slots (decode graphs' form): `decode.short_conv_decode_ref`."""
    from localllm.kernels.recurrent.decode import short_conv_decode_ref
    from localllm.kernels.recurrent.triton_step import conv_step_triton

    gen = torch.Generator().manual_seed(c * k)
    w = torch.randn(c, k, generator=gen) / k**0.5
    bias = 0.5 * torch.randn(c, generator=gen) if bias_silu else None
    ref = _slotted(torch.randn(3, k - 1, c, generator=gen))
    got_states = ref.clone().to(DEVICE)
    slots = torch.tensor(SLOTS)
    dev_bias = None if bias is None else bias.to(DEVICE)
    for step in range(3):
        fresh = torch.tensor(FRESH) if step == 0 else torch.zeros(3, dtype=torch.bool)
        x = torch.randn(3, c, generator=gen)
        want = short_conv_decode_ref(x, w, ref, slots, fresh, bias, bias_silu)
        x_, w_, slots_, fresh_ = (t.to(DEVICE) for t in (x, w, slots, fresh))
        got = conv_step_triton(x_, w_, got_states, dev_bias, bias_silu, slots_, fresh_)
        assert (got.cpu() - want).abs().max() < TOL, step
        assert torch.equal(got_states.cpu(), ref), step  # moved, not computed; others untouched


@pytest.mark.parametrize(("h", "c"), [(48, 3328), (5, 96)])
def test_conv_step_makes_mamba2_dt_in_the_same_launch(h, c):
    """`granitehybrid.FUSED_MIXER`: x and dt column slices of the in-projection's rows [z | xBC |
    dt]; the conv as without dt, dt' = softplus(dt + bias) as torch's (past its threshold 20
    too, and far below), the slots' states as without."""
    from localllm.kernels.recurrent.triton_step import conv_step_triton

    gen = torch.Generator().manual_seed(h + c)
    k = 4
    w, bias = torch.randn(c, k, generator=gen) / k**0.5, 0.5 * torch.randn(c, generator=gen)
    dt_bias = torch.randn(h, generator=gen)
    states = _slotted(torch.randn(3, k - 1, c, generator=gen)).to(DEVICE)
    again = states.clone()
    rows = torch.randn(3, 64 + c + h, generator=gen) * 4
    rows[0, 64 + c] = 30.0  # past softplus' threshold
    rows[1, 64 + c] = -40.0
    rows = rows.to(DEVICE)
    slots, fresh = torch.tensor(SLOTS).to(DEVICE), torch.tensor(FRESH).to(DEVICE)
    xbc, dt = rows[:, 64 : 64 + c], rows[:, 64 + c :]
    args = (w.to(DEVICE), states, bias.to(DEVICE), True, slots, fresh)
    y, dto = conv_step_triton(xbc, *args, dt=dt, dt_bias=dt_bias.to(DEVICE))
    want = conv_step_triton(xbc, w.to(DEVICE), again, bias.to(DEVICE), True, slots, fresh)
    assert torch.equal(y, want) and torch.equal(states, again)
    ref = F.softplus(dt.cpu() + dt_bias)
    assert dto.shape == (3, h) and (dto.cpu() - ref).abs().max() < 1e-6 * ref.abs().max()


@pytest.mark.parametrize("c", [2048, 96, 300])
def test_gated_conv_step_writes_the_out_projections_int8_rows(c):
    """`lfm2.CONV_QUANT`: LFM2's gated step with `quant`, the same output and states, and its
    int8 rows exactly what `quantize_x8` makes of it (blocks past the first at their offsets);
    none where C is no multiple of 32 (300) or the output is not float32."""
    from localllm.kernels.recurrent.triton_step import conv_step_triton

    gen = torch.Generator().manual_seed(c)
    k = 3
    w = (torch.randn(c, k, generator=gen) / k**0.5).to(DEVICE)
    states = _slotted(torch.randn(3, k - 1, c, generator=gen)).to(DEVICE)
    again = states.clone()
    bcx = torch.randn(3, 3 * c, generator=gen).to(DEVICE)
    slots, fresh = torch.tensor(SLOTS).to(DEVICE), torch.tensor(FRESH).to(DEVICE)
    step = {"slots": slots, "fresh": fresh, "gated": True}
    y, yq = conv_step_triton(bcx, w, states, **step, quant=True)
    assert torch.equal(y, conv_step_triton(bcx, w, again, **step))
    assert torch.equal(states, again)
    if c % 32:
        assert yq is None
        return
    assert_int8_rows_of(yq, y)
    half = conv_step_triton(bcx, w, states, **step, out_dtype=torch.float16, quant=True)
    assert half[1] is None


@pytest.mark.parametrize(("c", "k"), [(96, 4), (300, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gated_conv_step_on_slots_matches_reference(c, k, dtype):
    """LFM2's gated form in one launch: rows (B, C, x) of the in-projection, C * conv(B * x) in
    `dtype`, against B * x through `decode.short_conv_decode_ref` times C (products in float32,
    as the kernel's)."""
    from localllm.kernels.recurrent.decode import short_conv_decode_ref
    from localllm.kernels.recurrent.triton_step import conv_step_triton

    gen = torch.Generator().manual_seed(c * k + 1)
    w = torch.randn(c, k, generator=gen) / k**0.5
    ref = _slotted(torch.randn(3, k - 1, c, generator=gen))
    got_states = ref.clone().to(DEVICE)
    slots = torch.tensor(SLOTS)
    for step in range(3):
        fresh = torch.tensor(FRESH) if step == 0 else torch.zeros(3, dtype=torch.bool)
        bcx = torch.randn(3, 3 * c, generator=gen).to(dtype)
        b, gate, x = bcx.float().split(c, dim=-1)
        want = gate * short_conv_decode_ref(b * x, w, ref, slots, fresh)
        got = conv_step_triton(bcx.to(DEVICE), w.to(DEVICE), got_states, slots=slots.to(DEVICE),
                               fresh=fresh.to(DEVICE), gated=True, out_dtype=dtype)  # fmt: skip
        assert got.dtype == dtype
        tol = TOL if dtype == torch.float32 else 4e-3 * want.abs().max().item()
        assert (got.cpu().float() - want).abs().max() < tol, step
        # the state holds B * x in float32 (the products, not the rows)
        assert (got_states.cpu()[SLOTS] - ref[SLOTS]).abs().max() < TOL, step
        others = [i for i in range(5) if i not in SLOTS]
        assert (got_states.cpu()[others] == 7.0).all(), step


@pytest.mark.parametrize(("h", "p", "g", "n"), [(4, 16, 2, 8), (48, 64, 1, 128)])
def test_ssd_step_on_slots_matches_reference(h, p, g, n):
    """In place on the state slots (decode graphs' form): `decode.ssd_decode_ref`."""
    from localllm.kernels.recurrent.decode import ssd_decode_ref
    from localllm.kernels.recurrent.triton_step import ssd_step_triton

    gen = torch.Generator().manual_seed(h + p)
    a = -torch.rand(h, generator=gen) * 4 - 0.1
    ref = _slotted(0.5 * torch.randn(3, h, p, n, generator=gen))
    got_states = ref.clone().to(DEVICE)
    slots = torch.tensor(SLOTS)
    for step in range(3):
        fresh = torch.tensor(FRESH) if step == 0 else torch.zeros(3, dtype=torch.bool)
        x = torch.randn(3, h, p, generator=gen)
        dt = F.softplus(torch.randn(3, h, generator=gen))
        b, c = torch.randn(3, g, n, generator=gen), torch.randn(3, g, n, generator=gen)
        want = ssd_decode_ref(x, dt, a, b, c, ref, slots, fresh)
        args = [t.to(DEVICE) for t in (x, dt, a, b, c)]
        got = ssd_step_triton(*args, got_states, slots.to(DEVICE), fresh.to(DEVICE))
        assert (got.cpu() - want).abs().max() < TOL * 10, step
        assert (got_states.cpu()[SLOTS] - ref[SLOTS]).abs().max() < TOL, step
        others = [i for i in range(5) if i not in SLOTS]
        assert (got_states.cpu()[others] == 7.0).all(), step


def _on(batch):
    """`batch` with its slots on the device, its sequence in state slot 1."""
    from localllm.engine.core.batch import BatchMeta

    return BatchMeta(batch.query_start, batch.seq_lens, batch.block_tables,
                     batch.slot_mapping.to(DEVICE), batch.block_size, state_slots=(1,))  # fmt: skip


@pytest.mark.parametrize(
    ("name", "prompt", "chunked", "fused"),
    [("lfm2", 9, False, False), ("lfm2", 9, False, True), ("granitehybrid", 9, False, False),
     ("granitehybrid", 37, True, False), ("granitehybrid", 9, False, True)],
)  # fmt: skip
def test_fixture_decodes_through_the_triton_steps(name, prompt, chunked, fused, monkeypatch):
    """The converted fixtures through the Triton kernels in the model (the layers' wiring: rows,
    slots, bias and SiLU): a prompt (the varlen kernels; `chunked`: Mamba-2's scan in chunks of
    16, `triton_ssd_chunked`, over 3 chunks), then token by token (the steps): transformers'
    logits, as the torch path gives. `fused`: `granitehybrid.FUSED_MIXER` (the conv step and
    dt's softplus in one launch) and `FUSED_RESIDUAL` too; `lfm2.CONV_QUANT` (its wiring: the
    int8 rows need a GPU's packed out_proj)."""
    import localllm.engine.layers.recurrent as layers
    from localllm.engine.models import granitehybrid, lfm2

    monkeypatch.setattr(granitehybrid, "FUSED_MIXER", fused)
    monkeypatch.setattr(granitehybrid, "FUSED_RESIDUAL", fused)
    monkeypatch.setattr(lfm2, "CONV_QUANT", fused)
    import localllm.kernels.recurrent.gated_norm as gated_norm
    import localllm.kernels.recurrent.ssd as ssd
    import localllm.kernels.recurrent.triton_ssd_chunked as chunked_scan

    monkeypatch.setattr(layers, "CHUNKED_MIN_ROWS", 16 if chunked else 1 << 30)
    monkeypatch.setattr(chunked_scan, "CHUNK", 16)
    from localllm.engine.core.batch import BatchMeta
    from localllm.engine.gguf import open_gguf
    from localllm.engine.loader import build_model
    from localllm.engine.runtime.kv_cache import PagedKVCache
    from localllm.engine.runtime.recurrent_state import attach_states
    from tests.engine.family_goldens import golden_logits, path, sequence

    monkeypatch.setattr(layers, "use_triton", lambda x: True)
    monkeypatch.setattr(ssd, "use_triton", lambda s: True)
    monkeypatch.setattr(gated_norm, "use_triton", lambda y: True)
    ids = sequence(name)
    with open_gguf(path(name)) as g, torch.inference_mode():
        model = build_model(g, precise=True, device=DEVICE)
        layers_, heads, dim = model.kv_shape()
        kv = PagedKVCache(layers_, len(ids), 4, heads, dim, "f32", DEVICE)
        attach_states(kv, model, 2)
        rows = []
        # the first tokens as one prompt (the varlen kernels), then token by token (the steps)
        h = model(torch.tensor(ids[:prompt], device=DEVICE), torch.arange(prompt, device=DEVICE),
                  _on(BatchMeta.contiguous(prompt, prompt, 4)), kv)  # fmt: skip
        rows.append(model.logits(h).float().cpu())
        for t, tok in enumerate(ids):
            if t < prompt:
                continue
            batch = _on(BatchMeta.contiguous(1, t + 1, 4))
            ids_t = torch.tensor([tok], device=DEVICE)
            pos = torch.tensor([t], device=DEVICE)
            rows.append(model.logits(model(ids_t, pos, batch, kv)).float().cpu())
    # CPU (interpreted): only the steps differ from the precise torch path; CUDA: its attention
    # and matmul kernels sum in other orders too
    tol = 2e-3 if DEVICE == "cuda" else 1e-4
    assert (torch.cat(rows) - golden_logits(name)).abs().max() < tol


LENS = [5, 1, 17, 2, 1]  # a flat batch: chunks and single tokens, sequences shorter than K - 1


def _qs():
    import itertools

    return torch.tensor([0, *itertools.accumulate(LENS)], dtype=torch.int32)


@pytest.mark.parametrize(("k", "strided"), [(4, False), (3, False), (4, True)])
def test_conv_varlen_matches_reference(k, strided):
    """`strided`: x a column slice of wider rows (Mamba-2's xBC in its projection's output)."""
    from localllm.kernels.recurrent.causal_conv import causal_conv_prefill
    from localllm.kernels.recurrent.triton_step import conv_varlen_triton

    gen = torch.Generator().manual_seed(k)
    c, qs = 96, _qs()
    w, bias = torch.randn(c, k, generator=gen) / k**0.5, 0.5 * torch.randn(c, generator=gen)
    wide = torch.randn(int(qs[-1]), c + 40 * strided, generator=gen)
    x = wide[:, 40 * strided :]
    state = torch.randn(len(LENS), k - 1, c, generator=gen)
    ref = state.clone()
    bounds = list(zip(qs[:-1].tolist(), qs[1:].tolist(), strict=True))
    want = torch.cat([F.silu(causal_conv_prefill(x[s:e], w, ref[i], silu=False) + bias)
                      for i, (s, e) in enumerate(bounds)])  # fmt: skip
    got_state = state.clone().to(DEVICE)
    xd = wide.to(DEVICE)[:, 40 * strided :]  # (sliced on the device: .to would compact it)
    got = conv_varlen_triton(xd, w.to(DEVICE), got_state, qs.to(DEVICE), bias.to(DEVICE),
                             silu=True)  # fmt: skip
    assert (got.cpu() - want).abs().max() < TOL
    assert (got_state.cpu() - ref).abs().max() == 0


def test_ssd_varlen_matches_reference():
    from localllm.kernels.recurrent.ssd import ssd_scan
    from localllm.kernels.recurrent.triton_step import ssd_varlen_triton

    gen = torch.Generator().manual_seed(7)
    h, p, g, n, qs = 6, 20, 3, 12, _qs()
    t = int(qs[-1])
    x, dt = torch.randn(t, h, p, generator=gen), F.softplus(torch.randn(t, h, generator=gen))
    a = -torch.rand(h, generator=gen) * 2 - 0.05
    b, c = torch.randn(t, g, n, generator=gen), torch.randn(t, g, n, generator=gen)
    state = 0.5 * torch.randn(len(LENS), h, p, n, generator=gen)
    ref = state.clone()
    bounds = list(zip(qs[:-1].tolist(), qs[1:].tolist(), strict=True))
    want = torch.cat([ssd_scan(x[s:e], dt[s:e], a, b[s:e], c[s:e], ref[i])
                      for i, (s, e) in enumerate(bounds)])  # fmt: skip
    got_state = state.clone().to(DEVICE)
    args = (v.to(DEVICE) for v in (x, dt, a, b, c))
    got = ssd_varlen_triton(*args, got_state, qs.to(DEVICE))
    assert (got.cpu() - want).abs().max() < TOL * 10
    assert (got_state.cpu() - ref).abs().max() < TOL * 10
