"""qwen3next (Qwen3-Next: gated DeltaNet + gated attention + sparse MoE) against transformers, on
the file llama.cpp's converter made (tests/tools/record_qwen3next_fixture.py).

The fixture is a tiny random-weight Qwen3NextForCausalLM (layers 0-2 DeltaNet, 3 full
attention, two key heads serving four value heads, 8 experts top-2 plus a gated shared expert,
an MTP block the converter keeps), its weights float16-exact, converted to an F16 GGUF; its JSON
holds transformers' fp32 logits (torch fallbacks of the delta rule and the conv) over a prompt
and its greedy continuation. Our precise path must give those logits within LOGIT_TOL whole, in
chunks (the recurrent state carried in its slot between them), batched with other sequences in
other slots, and through the engine (batch of 4, preemption, n = 2 forks) the same greedy tokens
as the sequence alone.
"""

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from localllm.engine.core.batch import BatchMeta
from localllm.engine.generator import Generator
from localllm.engine.gguf import open_gguf
from localllm.engine.llm import LLM
from localllm.engine.loader import build_model
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.engine.runtime.recurrent_state import attach_states
from localllm.engine.sampling.params import SamplingParams
from localllm.engine.tokenizer import Tokenizer
from tests.engine.family_goldens import assert_greedy_matches, golden, golden_logits, path

NAME = "qwen3next"
# fp32 vs fp32 on the same weights; the delta rule's chunked form and the conv sum in other
# orders than transformers' (measured max 4.4e-5 whole, over logits of std 1.05)
LOGIT_TOL = 2e-4
FAST_TOL = 2e-2  # default CPU kernels (F16 weights prepared for the CPU matmuls)
TIE = 1e-3  # precise path: a greedy step may differ only where transformers' top two are this close
FAST_TIE = 0.05  # default kernels (tests/engine/near_ties.py's bound)
BLOCK = 4  # small KV blocks: the sequences span many, some partly filled


@pytest.fixture(scope="module")
def model():
    with open_gguf(path(NAME)) as g:
        yield build_model(g, precise=True)


def ids() -> list[int]:
    g = golden(NAME)
    return g["prompt"]["ids"] + g["greedy_ids"]


def new_cache(model, tokens: int, slots: int = 1) -> PagedKVCache:
    layers, kv_heads, head_dim = model.kv_shape()
    kv = PagedKVCache(layers, -(-tokens // BLOCK), BLOCK, kv_heads, head_dim, dtype="f32")
    attach_states(kv, model, slots)
    return kv


@torch.inference_mode()
def full_logits(model, seq: list[int]) -> torch.Tensor:
    n = len(seq)
    kv = new_cache(model, n)
    return model.logits(
        model(torch.tensor(seq), torch.arange(n), BatchMeta.contiguous(n, n, BLOCK), kv)
    )


def max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got - want).abs().max().item()


def test_layout(model):
    """Layers 0-2 recurrent, 3 attention (the only KV layer); the MTP block is not built."""
    a = model.args
    assert a.n_layers == 4 and a.n_nextn == 1
    assert [type(b).__name__ for b in model.blk] == ["DeltaNetBlock"] * 3 + ["AttentionBlock"]
    assert model.kv_shape() == (1, 2, 16)
    assert model.state_shapes() == {i: {"conv": (3, 64), "ssm": (4, 8, 8)} for i in range(3)}


def test_logits_match_transformers(model):
    want = golden_logits(NAME)
    assert want.std() > 0.5  # logits carry signal: a broken model cannot match by accident
    got = full_logits(model, ids())
    assert got.shape == want.shape
    assert max_err(got, want) < LOGIT_TOL


# chunk plans over the 43-token sequence: uneven prefill chunks, then decode steps
CHUNKS = {"3+7+rest": [3, 7], "13 then decode": [13, *[1] * 40], "decode only": [1] * 43}


@pytest.mark.parametrize("plan", list(CHUNKS))
@torch.inference_mode()
def test_chunked_prefill_matches_transformers(model, plan):
    """The same sequence in chunks (chunked prefill, then decode steps): the conv inputs and the
    delta state carried in the slot between them; each chunk's logits are transformers' rows."""
    seq, want = ids(), golden_logits(NAME)
    kv = new_cache(model, len(seq))
    bounds = [0, *itertools.accumulate(CHUNKS[plan])]
    bounds = [b for b in bounds if b < len(seq)] + [len(seq)]
    for s, e in itertools.pairwise(bounds):
        batch = BatchMeta.contiguous(e - s, e, BLOCK)
        h = model(torch.tensor(seq[s:e]), torch.arange(s, e), batch, kv)
        assert max_err(model.logits(h), want[s:e]) < LOGIT_TOL, (plan, s, e)


@torch.inference_mode()
@pytest.mark.parametrize("norms", [False, True])
def test_fused_ffn_matches_transformers(norms, monkeypatch):
    """`qwen3next.FUSED_DECODE`'s FFN (the norm's rows to both expert paths, one gated add at
    its end; on a CPU the torch forms of both) keeps transformers' logits, whole and in decode
    steps; `norms`: with `FUSED_NORMS` (the residual add in the norm, the gate's logit in the
    end's launch). Its CUDA-only parts (the three input linears as one, g and beta in the rule's
    launch, the gated norm's launch and int8 rows) are tested under the Triton interpreter
    (tests/kernels/test_recurrent_triton.py, test_fused.py)."""
    from localllm.engine.models import qwen3next

    monkeypatch.setattr(qwen3next, "FUSED_DECODE", True)
    monkeypatch.setattr(qwen3next, "FUSED_NORMS", norms)
    with open_gguf(path(NAME)) as g:
        fused = build_model(g, precise=True)
    seq, want = ids(), golden_logits(NAME)
    assert max_err(full_logits(fused, seq), want) < LOGIT_TOL
    kv = new_cache(fused, len(seq))
    for s, e in itertools.pairwise([0, 13, *range(14, len(seq) + 1)]):
        h = fused(
            torch.tensor(seq[s:e]), torch.arange(s, e), BatchMeta.contiguous(e - s, e, BLOCK), kv
        )
        assert max_err(fused.logits(h), want[s:e]) < LOGIT_TOL, (s, e)


@torch.inference_mode()
def test_batch_of_four_in_other_slots_matches_alone(model):
    """Four sequences prefilled in one flat step (state slots 2, 0, 3, 1, interleaved block
    tables), then decoded together: each one's logits are its own alone."""
    seq = ids()
    seqs = [seq[:30], seq[::-1][:17], seq[5:26], seq[10:19]]
    alone = [full_logits(model, s) for s in seqs]
    slots = (2, 0, 3, 1)
    prompt = [len(s) - 4 for s in seqs]  # the last 4 tokens of each go by decode steps
    per = max(-(-len(s) // BLOCK) for s in seqs)
    kv = new_cache(model, 4 * per * BLOCK, slots=4)
    tables = tuple(tuple(range(i, 4 * per, 4)) for i in range(4))
    batch = BatchMeta.from_tables(prompt, prompt, tables, BLOCK)
    batch = dataclasses.replace(batch, state_slots=slots)
    flat = torch.tensor([t for s, n in zip(seqs, prompt, strict=True) for t in s[:n]])
    pos = torch.cat([torch.arange(n) for n in prompt])
    out = model.logits(model(flat, pos, batch, kv))
    starts = [0, *itertools.accumulate(prompt)]
    for i, n in enumerate(prompt):
        assert max_err(out[starts[i] : starts[i] + n], alone[i][:n]) < LOGIT_TOL, i
    for step in range(4):
        lens = [n + step + 1 for n in prompt]
        batch = BatchMeta.from_tables([1] * 4, lens, tables, BLOCK)
        batch = dataclasses.replace(batch, state_slots=slots)
        toks = torch.tensor([s[n - 1] for s, n in zip(seqs, lens, strict=True)])
        out = model.logits(model(toks, torch.tensor(lens) - 1, batch, kv))
        for i, n in enumerate(lens):
            assert max_err(out[i], alone[i][n - 1]) < LOGIT_TOL, (step, i)


def test_greedy_tokens_match_transformers(model):
    with open_gguf(path(NAME)) as g:
        gen = Generator(g, model, Tokenizer.from_gguf_metadata(g.metadata), load_seconds=0.0)
        n = len(golden(NAME)["greedy_ids"])
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        got = list(gen.stream(golden(NAME)["prompt"]["ids"], params))
    assert_greedy_matches(NAME, got, TIE)


def greedy(n: int = 10) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _prompts() -> list[list[int]]:
    p = golden(NAME)["prompt"]["ids"]
    return [p, p[::-1], p[3:] + p[:3], p[7:29]]


def _same_or_near_tie(got: list[int], alone, tie: float) -> None:
    """`got` equals the run alone (`alone`: its output with top-5 logprobs), or parts from it
    only where the run alone scored both choices within `tie` (same context up to there)."""
    want = list(alone.token_ids)
    i = next((j for j, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
    if i is None:
        return
    top = alone.logprobs[i]
    assert got[i] in top, (i, got, want)
    gap = top[want[i]].logprob - top[got[i]].logprob
    assert gap < tie, f"step {i} took {got[i]} over {want[i]}, {gap:.3g} apart: no tie"


@pytest.mark.parametrize("precise", [True, False], ids=["precise", "default-kernels"])
def test_engine_batch_of_four_chunked_greedy(precise):
    """Through the scheduler: four prompts prefilled 8 tokens a step (chunks of one prompt
    carry its state between steps), decoded together; the golden prompt's tokens are
    transformers' and every prompt's tokens are its own alone (the default kernels: or part at
    a near-tie, batched rows rounding otherwise than one row)."""
    kv = "f32" if precise else "f16"
    kw = dict(precise=precise, max_num_batched_tokens=8, block_size=BLOCK, kv_cache_dtype=kv,
              max_model_len=128)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=5)
    with LLM(str(path(NAME)), **kw) as llm:
        together = [list(o.outputs[0].token_ids) for o in llm.generate(_prompts(), params)]
        alone = [llm.generate([p], params)[0].outputs[0] for p in _prompts()]
    assert_greedy_matches(NAME, together[0], TIE if precise else FAST_TIE)
    if precise:
        assert together == [list(a.token_ids) for a in alone]
    for got, a in zip(together, alone, strict=True):
        _same_or_near_tie(got, a, FAST_TIE)


def test_engine_preemption_and_resume():
    """20 KV blocks of 4 for four growing sequences (49 blocks in all): some are preempted
    (their slot given back) and recomputed from the start; their tokens stay their own."""
    prompts = _prompts()
    with LLM(str(path(NAME)), precise=True, block_size=BLOCK, max_model_len=128,
             kv_cache_dtype="f32") as llm:  # fmt: skip
        want = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy(16))]
        per_block = llm.engine.kv_plan.bytes_per_block
    with LLM(str(path(NAME)), precise=True, block_size=BLOCK, max_model_len=128,
             kv_cache_dtype="f32", kv_cache_memory=20 * per_block) as small:  # fmt: skip
        got = [list(o.outputs[0].token_ids) for o in small.generate(prompts, greedy(16))]
        assert small.engine.scheduler.num_preemptions > 0
    assert got == want


def test_engine_n2_forks_equal_alone():
    """n = 2 greedy completions fork at the prompt's shared blocks, the second taking a copy of
    the first's state there: both equal the prompt run alone."""
    prompt = golden(NAME)["prompt"]["ids"]
    with LLM(str(path(NAME)), precise=True, block_size=BLOCK, max_model_len=128,
             kv_cache_dtype="f32") as llm:  # fmt: skip
        alone = list(llm.generate([prompt], greedy())[0].outputs[0].token_ids)
        params = SamplingParams(n=2, temperature=0.0, max_tokens=10, ignore_eos=True)
        out = llm.generate([prompt], params)[0]
    assert [list(c.token_ids) for c in out.outputs] == [alone, alone]
    assert_greedy_matches(NAME, alone, TIE)


def test_default_kernels_stay_close():
    with open_gguf(path(NAME)) as g:
        got = full_logits(build_model(g), ids())
    assert max_err(got, golden_logits(NAME)) < FAST_TOL


def test_tokenizer_and_chat_template_match_transformers():
    from localllm.engine.tokenizer import ChatTemplate

    g = golden(NAME)
    with open_gguf(path(NAME)) as f:
        tok = Tokenizer.from_gguf_metadata(f.metadata)
    assert tok.encode(g["prompt"]["text"]) == g["prompt"]["ids"]
    template = ChatTemplate.for_tokenizer(tok)
    assert set(g["renders"]) == {"chat", "tools", "no_thinking"}
    for case, r in g["renders"].items():
        text = template.render(r["messages"], tools=r["tools"], **r["kwargs"])
        assert text == r["text"], case
        assert tok.encode(text, add_special=False, parse_special=True) == r["ids"], case


# -- each part of the architecture matters ----------------------------------------------------


def _moved(model) -> float:
    return max_err(full_logits(model, ids()), golden_logits(NAME))


def test_state_carry_matters(model):
    """Dropping the delta state between chunks (a sequence seen as fresh at every chunk) moves
    the logits far past the tolerance: the chunked test above does check the carry."""
    seq, want = ids(), golden_logits(NAME)
    kv = new_cache(model, len(seq))
    with torch.inference_mode():
        model(torch.tensor(seq[:13]), torch.arange(13), BatchMeta.contiguous(13, 13, BLOCK), kv)
        for st in kv.states._t.values():
            st["ssm"].zero_()
        n = len(seq)
        h = model(
            torch.tensor(seq[13:]), torch.arange(13, n), BatchMeta.contiguous(n - 13, n, BLOCK), kv
        )
    assert max_err(model.logits(h), want[13:]) > 100 * LOGIT_TOL


@pytest.mark.parametrize("part", ["attention output gate", "shared expert gate", "conv"])
def test_each_gate_matters(model, part):
    """The attention's sigmoid output gate, the shared expert's gate and the short conv each
    move the logits far past the tolerance when bypassed."""
    blk0, blk3 = model.blk[0], model.blk[3]
    if part == "attention output gate":
        project = blk3.attn_q.forward

        def open_gate(h, hq=None):  # every gate logit 40: sigmoid 1, as if there were none
            y = project(h, hq).view(h.shape[0], 4, 2, 16).clone()
            y[:, :, 1] = 40.0
            return y.reshape(h.shape[0], -1)

        blk3.attn_q.forward = open_gate
        try:
            assert _moved(model) > 100 * LOGIT_TOL
        finally:
            del blk3.attn_q.forward
        return
    p = blk0.ffn_gate_inp_shexp if part == "shared expert gate" else blk0.ssm_conv1d
    saved = p.value
    # a zero gate logit halves the shared expert; a conv of ones over the last taps only
    p.value = torch.zeros_like(saved) if part != "conv" else torch.eye(4)[-1].expand_as(saved)
    try:
        assert _moved(model) > 100 * LOGIT_TOL
    finally:
        p.value = saved


# -- hostile files --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("ssm.group_count", 3, "not a multiple of ssm.group_count"),
        ("ssm.inner_size", 30, "does not split into 4 heads"),
        ("ssm.conv_kernel", 1, "expected 2 or more"),
        ("ssm.state_size", 16, "ssm_conv1d"),  # at odds with the tensors
        ("full_attention_interval", 0, "expected 1.."),
        ("nextn_predict_layers", 5, "no layer of 5 blocks is left"),
    ],
)
def test_hostile_keys_are_one_line_errors(key, value, needle, tmp_path):
    from gguf import GGUFValueType as VT

    from localllm.engine.config import EngineArgs
    from localllm.engine.llm_engine import LLMEngine
    from localllm.engine.loader import ModelLoadError
    from tests.engine.gguf_fixtures import GGUFValue
    from tests.engine.hostile_gguf import hparam, write_variant

    bad = write_variant(tmp_path / "h.gguf", NAME, {hparam(NAME, key): GGUFValue(value, VT.UINT32)})
    with pytest.raises(ModelLoadError) as e:
        LLMEngine(str(bad), EngineArgs(kv_cache_memory=1 << 20))
    msg = str(e.value)
    assert msg.startswith(f"{bad}: ") and needle in msg and "\n" not in msg, msg


def _legacy_ssm_in(tensors: dict, layer: int, a) -> np.ndarray:
    """What older conversions stored for `layer`: transformers' in_proj_qkvz, its rows grouped
    per key head (q, k, then the v and z rows of the value heads it serves), from the file's
    attn_qkv and attn_gate (the converter's split, undone)."""

    def rows(name):
        raw, _, shape = tensors[f"blk.{layer}.{name}.weight"]
        return np.asarray(raw).view(np.float16).reshape(shape)

    qkv, z = rows("attn_qkv"), rows("attn_gate")
    n, dk, vz = a.n_k_heads * a.head_k_dim, a.head_k_dim, a.value_dim // a.n_k_heads
    q, k, v = qkv[:n], qkv[n : 2 * n], qkv[2 * n :]
    groups = [
        np.concatenate(
            [
                q[h * dk : (h + 1) * dk],
                k[h * dk : (h + 1) * dk],
                v[h * vz : (h + 1) * vz],
                z[h * vz : (h + 1) * vz],
            ]
        )
        for h in range(a.n_k_heads)
    ]
    return np.concatenate(groups)


def test_legacy_ssm_in_files_give_the_same_logits(model, tmp_path):
    """A file with the older single `ssm_in` projection (llama.cpp still loads those) gives the
    split file's logits; a layer with neither, or both, is refused in one line."""
    from localllm.engine.loader import ModelLoadError
    from tests.engine.hostile_gguf import DELETE, base, write_variant

    tensors, a = base(NAME)[2], model.args
    legacy = {}
    for i in range(3):
        legacy[f"blk.{i}.ssm_in.weight"] = _legacy_ssm_in(tensors, i, a)
        legacy[f"blk.{i}.attn_qkv.weight"] = legacy[f"blk.{i}.attn_gate.weight"] = DELETE
    old = write_variant(tmp_path / "legacy.gguf", NAME, tensors=legacy)
    with open_gguf(old) as g:
        assert "blk.0.ssm_in.weight" in g.tensors and "blk.0.attn_qkv.weight" not in g.tensors
        got = full_logits(build_model(g, precise=True), ids())
    assert max_err(got, full_logits(model, ids())) < 1e-5
    assert max_err(got, golden_logits(NAME)) < LOGIT_TOL
    for bad in ({"blk.1.ssm_in.weight": legacy["blk.1.ssm_in.weight"]},
                {"blk.1.attn_gate.weight": DELETE}):  # fmt: skip
        path_ = write_variant(tmp_path / "bad.gguf", NAME, tensors=bad)
        with open_gguf(path_) as g, pytest.raises(ModelLoadError) as e:
            build_model(g, precise=True)
        assert "blk.1: expected attn_qkv and attn_gate, or ssm_in alone" in str(e.value)
