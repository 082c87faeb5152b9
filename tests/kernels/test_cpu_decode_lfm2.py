"""The native CPU decode step on LFM2 (`kernels/cpu/decode_step.c`'s short-conv layers beside its
attention layers): the converted tiny lfm2 fixture (tests/data/families, transformers' weights)
with its linears made Q8_0 so that they run on the native block kernels. The step against its
torch reference (`decode_step_reference`: outputs and the conv states it leaves), teacher-forced
decode logits against the torch layers on the same int8-activation linears and against exact
math, rows of several sequences in other state slots against each alone, and bad layouts
refused."""

import dataclasses

import gguf
import numpy as np
import pytest
import torch

from localllm.engine.core.batch import BatchMeta
from localllm.engine.gguf import open_gguf
from localllm.engine.layers.native_decode import NativeDecode
from localllm.engine.loader import build_model
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.engine.runtime.recurrent_state import attach_states
from localllm.kernels.cpu import decode_step, decode_step_ref
from localllm.kernels.quant import QuantType
from localllm.kernels.quant.linear_native import NativeLinear
from tests.engine.gguf_fixtures import write_gguf
from tests.engine.hostile_gguf import base

BS = 16
pytestmark = pytest.mark.skipif(decode_step.load() is None, reason="no C compiler")


@pytest.fixture(scope="module")
def lfm2_q8(tmp_path_factory):
    """The lfm2 fixture with every F16 matrix quantized to Q8_0 by gguf-py (norms and the conv
    taps stay as they are)."""
    arch, meta, tensors = base("lfm2")
    out = {}
    for name, (raw, qt, shape) in tensors.items():
        if int(qt) == int(QuantType.F16) and len(shape) == 2 and shape[1] % 32 == 0:
            w = np.frombuffer(raw.tobytes(), np.float16).reshape(shape).astype(np.float32)
            raw, qt = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0), QuantType.Q8_0
        out[name] = (raw, qt, shape)
    path = write_gguf(tmp_path_factory.mktemp("lfm2") / "lfm2-q8_0.gguf", meta, out, arch=arch)
    g = open_gguf(str(path))
    yield g
    g.close()


def _model(g, native: bool, precise: bool = False):
    model = build_model(g, precise=precise)
    if not native:  # the torch layers on the step's int8 activations
        model._native_step = False
        for m in model.modules():
            for k in m.kernels() if callable(getattr(m, "kernels", None)) else ():
                if isinstance(k, NativeLinear):
                    k.int8_max_t = 64
    return model


def _cache(model, slots: int = 4) -> PagedKVCache:
    layers, kvh, hd = model.kv_shape()
    kv = PagedKVCache(layers, 16, BS, kvh, hd, "f32", "cpu")
    attach_states(kv, model, slots)
    return kv


def _prompt(model, kv, tokens: list[int], slot: int, table: tuple[int, ...]) -> None:
    n = len(tokens)
    sm = torch.tensor([table[p // BS] * BS + p % BS for p in range(n)])
    batch = BatchMeta((0, n), (n,), (table,), sm, BS, state_slots=(slot,))
    model(torch.tensor(tokens), torch.arange(n), batch, kv)


def _decode(model, kv, rows: list[tuple[int, int, int, tuple[int, ...]]]) -> torch.Tensor:
    """One step of (token, position, state slot, block table) rows -> logits [rows, vocab]."""
    t = len(rows)
    sm = torch.tensor([tb[p // BS] * BS + p % BS for _, p, _, tb in rows])
    batch = BatchMeta(tuple(range(t + 1)), tuple(p + 1 for _, p, _, _ in rows),
                      tuple(tb for *_, tb in rows), sm, BS,
                      state_slots=tuple(s for _, _, s, _ in rows))  # fmt: skip
    ids = torch.tensor([tok for tok, *_ in rows])
    pos = torch.tensor([p for _, p, _, _ in rows])
    return model.logits(model(ids, pos, batch, kv)).double()


def _teacher_forced(g, tokens: list[int], n_prompt: int, native: bool, precise=False):
    model = _model(g, native, precise)
    kv = _cache(model)
    table = (0, 1, 2)
    with torch.inference_mode():
        _prompt(model, kv, tokens[:n_prompt], 0, table)
        out = [_decode(model, kv, [(tokens[p], p, 0, table)])[0]
               for p in range(n_prompt, len(tokens))]  # fmt: skip
    return torch.stack(out), isinstance(model._native_step, NativeDecode)


def _kl(p: torch.Tensor, q: torch.Tensor) -> float:
    lp, lq = p.log_softmax(-1), q.log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1).mean().item()


def test_the_step_equals_its_torch_reference_and_moves_the_states(lfm2_q8):
    model = _model(lfm2_q8, native=True)
    kv = _cache(model)
    nd = NativeDecode.for_model(model)
    assert nd is not None, "the native step did not take lfm2"
    step = nd._for_cache(kv)
    assert step.convs == 3  # blk.0, 1, 3 convolve; blk.2 attends
    g = torch.Generator().manual_seed(1)
    for spec in step.specs:  # random history in every state and cache
        for t in (spec.conv_state, spec.k_cache, spec.v_cache):
            if t is not None:
                t.copy_(torch.randn(t.shape, generator=g))
    rows, dim = 3, nd.shape.dim
    x = torch.randn(rows, dim, generator=g)
    positions = torch.tensor([7, 20, 3])
    cos, sin = (c.contiguous() for c in model.rotary.cos_sin(positions))
    slots = torch.tensor([7, 20 + BS, 3 + 2 * BS])  # each row's KV slot in its own blocks
    seq_lens = positions + 1
    tables = torch.tensor([[0, 0], [0, 1], [2, 0]])
    state_slots = torch.tensor([2, 0, 3])  # not the row order
    ref_specs = [dataclasses.replace(s, **{n: getattr(s, n).clone() for n in
                 ("conv_state", "k_cache", "v_cache") if getattr(s, n) is not None})
                 for s in step.specs]  # fmt: skip
    want = decode_step_ref.decode_step_reference(nd.shape, ref_specs, BS, x, cos, sin, slots,
                                             seq_lens, tables, state_slots=state_slots)  # fmt: skip
    got = step(x.clone(), cos, sin, slots, seq_lens, tables, None, cos, sin, state_slots)
    assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()
    for s, r in zip(step.specs, ref_specs, strict=True):
        if s.conv_state is not None:  # shifted by one, the row's B x last; slot 1 untouched
            assert torch.allclose(s.conv_state, r.conv_state, atol=1e-5, rtol=1e-5)
    shifted = step.specs[0].conv_state[2, 0]
    assert not torch.equal(shifted, ref_specs[0].conv_state[1, 0])


def test_a_step_without_state_slots_is_refused(lfm2_q8):
    model = _model(lfm2_q8, native=True)
    step = NativeDecode.for_model(model)._for_cache(_cache(model))
    x, one = torch.zeros(1, step.shape.dim), torch.ones(1, dtype=torch.int64)
    cos = torch.ones(1, step.shape.rope_dims // 2)
    with pytest.raises(ValueError, match="state_slots"):
        step(x, cos, cos * 0, one, one + 1, torch.zeros(1, 1, dtype=torch.int64))


def test_a_bad_conv_state_is_refused(lfm2_q8):
    model = _model(lfm2_q8, native=True)
    step = NativeDecode.for_model(model)._for_cache(_cache(model))
    conv = next(s for s in step.specs if s.conv_w is not None)
    bad = dataclasses.replace(conv, conv_state=conv.conv_state[:, :1].contiguous())
    with pytest.raises(ValueError, match="conv state"):
        decode_step.DecodeStep(step.lib, step.shape, [bad], BS)


def test_decodes_like_the_torch_layers(lfm2_q8):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 150, (40,), generator=g).tolist()  # 40: past a 16-key block
    native, ran = _teacher_forced(lfm2_q8, tokens, 5, native=True)
    assert ran, "the native step did not take lfm2"
    torch_int8, ran = _teacher_forced(lfm2_q8, tokens, 5, native=False)
    assert not ran
    exact, _ = _teacher_forced(lfm2_q8, tokens, 5, native=False, precise=True)
    # the same int8 linears and the same conv either way (1.2e-6 apart when written)
    assert (native - torch_int8).abs().max().item() < 1e-4
    kl_native, kl_torch = _kl(exact, native), _kl(exact, torch_int8)
    assert kl_native < 1.5 * kl_torch + 1e-5, (kl_native, kl_torch)
    assert (native - exact).abs().max().item() > 1e-3  # (int8 activations: not exact math)


def test_rows_in_other_state_slots_equal_each_alone(lfm2_q8):
    """Three sequences decode in one step, in state slots 3, 0, 2: each row's logits as when it
    decodes alone (a wrong slot would read another sequence's convolution history)."""
    model = _model(lfm2_q8, native=True)
    seqs = [(list(range(3, 12)), 3, (0,)), (list(range(40, 60)), 0, (1, 2)),
            (list(range(90, 95)), 2, (3,))]  # fmt: skip
    with torch.inference_mode():
        alone = []
        for toks, slot, table in seqs:
            kv = _cache(model)
            _prompt(model, kv, toks[:-1], slot, table)
            alone.append(_decode(model, kv, [(toks[-1], len(toks) - 1, slot, table)])[0])
        kv = _cache(model)
        for toks, slot, table in seqs:
            _prompt(model, kv, toks[:-1], slot, table)
        rows = [(toks[-1], len(toks) - 1, slot, table) for toks, slot, table in seqs]
        together = _decode(model, kv, rows)
    assert isinstance(model._native_step, NativeDecode)
    for i, one in enumerate(alone):
        assert (together[i] - one).abs().max().item() < 1e-5, i
