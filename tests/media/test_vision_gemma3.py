"""Gemma 3 vision against transformers fp32 (tests/data/vision/*gemma3*, recorded by
tests/tools/record_gemma3_vision_fixtures.py from a tiny random-weight
Gemma3ForConditionalGeneration converted by llama.cpp's `convert_hf_to_gguf.py` and `--mmproj`).

Tolerances: pixel values equal (same Pillow BILINEAR, same float ops); encoder outputs within
1e-5 and logits within 1e-4 absolute (F16 weights widened to float32 on both sides; measured
0.0 and under 3e-6 on the 2-core CPU); greedy tokens equal. The image tokens attend to each other
both ways: the logits match transformers' token-type mask, and with the image spans withheld they
match transformers' causal-only logits instead (the two differ by up to 0.65).
"""

import dataclasses
import json
from functools import cache

import numpy as np
import pytest
import torch

from localllm.engine import EngineArgs, LLMEngine
from localllm.engine.core.batch import BatchMeta
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.media.vision.pipeline import VisionPipeline
from tests.media.vision_fixture import DATA, floats, image_bytes, run_greedy

TEXT = DATA / "gemma3-text.gguf"
MMPROJ = DATA / "mmproj-gemma3.gguf"
ENCODER_TOL = 1e-5
LOGIT_TOL = 1e-4


@cache
def record() -> dict:
    return json.loads((DATA / "gemma3.json").read_text())


@pytest.fixture(scope="module")
def engine():
    eng = LLMEngine(str(TEXT), EngineArgs(max_num_seqs=2))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def vision(engine):
    vp = VisionPipeline(MMPROJ, engine)
    yield vp
    vp.close()


def _prompt(vision, engine, name):
    chat = record()["chats"][name]
    images = [vision.prepare(image_bytes(n)) for n in chat["images"]]
    ids, mm = vision.chat(engine, chat["messages"], images)
    return chat, ids, mm


def _forward(engine, ids, mm, runs=None):
    """Hidden states of `ids` in one step with the images spliced in (a fresh cache); `runs`
    overrides the step's bidirectional spans."""
    m = engine.model
    layers, heads, hd = m.kv_shape()
    kv = PagedKVCache(layers, -(-len(ids) // 16), 16, heads, hd, dtype="f32")
    rows = torch.tensor([p for it in mm for p in it.positions])
    values = torch.cat([it.encoder() for it in mm])
    batch = dataclasses.replace(BatchMeta.contiguous(len(ids), len(ids), 16), embeds=(rows, values))
    if runs is not None:
        batch.plans["embed_runs"] = runs
    with torch.inference_mode():
        return m(torch.tensor(ids), torch.arange(len(ids)), batch, kv), kv


@pytest.mark.parametrize("name", ["tall.png", "wide.png"])
def test_pixel_values_equal_the_hf_processor(vision, name):
    ref = record()["images"][name]
    img = vision.prepare(image_bytes(name))
    np.testing.assert_array_equal(
        img.pixels.numpy(), floats(ref["pixel_values"], ref["pixel_shape"])
    )


@pytest.mark.parametrize("name", ["tall.png", "wide.png"])
def test_encoder_output_matches_transformers(vision, name):
    ref = record()["images"][name]
    out = vision.encode(vision.prepare(image_bytes(name)))
    want = floats(ref["image_features"], ref["feature_shape"])
    assert tuple(out.shape) == tuple(want.shape) == (16, 64)
    np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=ENCODER_TOL)


# the half tower (`siglip.Tower.use_half`, CUDA's default for F16/BF16 towers): measured 4.7e-4
# (float16) and 4.6e-3 (bfloat16) on the 2-core CPU against outputs up to 1.6; ~4x room
HALF_TOL = {torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", list(HALF_TOL))
def test_half_tower_stays_near_transformers_and_float32_comes_back(vision, dtype):
    ref = record()["images"]["tall.png"]
    want = floats(ref["image_features"], ref["feature_shape"])
    image = vision.prepare(image_bytes("tall.png"))
    try:
        vision.model.v.use_half(dtype)
        half = vision.encode(image).float().numpy()
    finally:
        vision.model.v.use_half(None)
    np.testing.assert_allclose(half, want, rtol=0, atol=HALF_TOL[dtype])
    assert np.abs(half - want).max() > 0  # the half path ran (float32 gives 0.0 here)
    np.testing.assert_allclose(vision.encode(image).numpy(), want, rtol=0, atol=ENCODER_TOL)


def test_half_tower_takes_only_half_dtypes(vision):
    with pytest.raises(ValueError, match=r"takes torch\.float16"):
        vision.model.v.use_half(torch.float64)


def test_cpu_keeps_float32_blocks_and_knows_the_stored_dtype(vision):
    """Half blocks are CUDA's choice for an F16/BF16 tower with `mmproj.HALF_TOWER` on
    (`mmproj.build_tower`), never a CPU's."""
    v = vision.model.v
    assert v.stored_half_dtype() == torch.float16  # this mmproj's block linears are F16
    assert all(blk.half_weights is None for blk in v.blk)


@pytest.mark.parametrize("name", ["one_image", "two_images"])
def test_prompt_ids_and_image_spans_equal_the_hf_processor(vision, engine, name):
    chat, ids, mm = _prompt(vision, engine, name)
    assert ids == chat["input_ids"]
    image = [i for i, t in enumerate(chat["token_type_ids"]) if t == 1]
    assert [p for it in mm for p in it.positions] == image
    assert all(it.end - it.start == len(it.positions) == 16 for it in mm)  # one run each


@pytest.mark.parametrize("name", ["one_image", "two_images"])
def test_logits_match_transformers_with_the_image_mask(vision, engine, name):
    chat, ids, mm = _prompt(vision, engine, name)
    full = ids + chat["greedy_ids"]
    hidden, _ = _forward(engine, full, mm)
    with torch.inference_mode():
        logits = engine.model.logits(hidden[len(ids) - 1 :]).numpy()
    want = floats(chat["logits"], (-1, record()["vocab_size"]))
    np.testing.assert_allclose(logits[: len(want)], want, rtol=0, atol=LOGIT_TOL)
    causal = floats(chat["causal_logits"], want.shape)
    assert np.abs(causal - want).max() > 100 * LOGIT_TOL  # the mask matters on this model


@pytest.mark.parametrize("name", ["one_image", "two_images"])
def test_without_the_spans_the_logits_are_transformers_causal_ones(vision, engine, name):
    """The same forward with the spans withheld is causal attention: it matches transformers'
    logits without token types, so the bidirectional part is exactly the image mask."""
    chat, ids, mm = _prompt(vision, engine, name)
    full = ids + chat["greedy_ids"]
    hidden, _ = _forward(engine, full, mm, runs=((),))
    with torch.inference_mode():
        logits = engine.model.logits(hidden[len(ids) - 1 :]).numpy()
    want = floats(chat["causal_logits"], (-1, record()["vocab_size"]))
    np.testing.assert_allclose(logits[: len(want)], want, rtol=0, atol=LOGIT_TOL)


@pytest.mark.parametrize("name", ["one_image", "two_images"])
def test_greedy_tokens_match_transformers(vision, engine, name):
    chat, ids, mm = _prompt(vision, engine, name)
    ours, _ = run_greedy(engine, ids, mm, len(chat["greedy_ids"]), rid=name)
    assert ours == chat["greedy_ids"]


def _chunks(eng):
    """Record every step's (first position, tokens) of the engine's one request."""
    seen, schedule = [], eng.scheduler.schedule

    def spy():
        out = schedule()
        seen.extend((r.num_computed_tokens, out.num_scheduled_tokens[r.request_id])
                    for r in out.requests)  # fmt: skip
        return out

    eng.scheduler.schedule = spy
    return seen


@pytest.mark.parametrize("budget", [8, 20])
def test_chunked_prefill_keeps_each_image_in_one_step(vision, budget):
    """A budget of 8 is smaller than an image (16 tokens): the step that reaches an image takes
    all of it; a budget of 20 would end a step inside the second image: the step stops before
    it. Either way the greedy tokens are transformers'."""
    eng = LLMEngine(str(TEXT), EngineArgs(max_num_seqs=1, max_num_batched_tokens=budget))
    try:
        chat, ids, mm = _prompt(vision, eng, "two_images")
        seen = _chunks(eng)
        ours, _ = run_greedy(eng, ids, mm, len(chat["greedy_ids"]))
        assert ours == chat["greedy_ids"]
        prefill = [(s, n) for s, n in seen if s < len(ids)]
        assert len(prefill) > 2  # the prompt was chunked
        for s, n in prefill:
            for it in mm:  # no step ends inside an image
                assert not it.start < s + n < it.end, (s, n, it.start, it.end)
        if budget == 8:
            assert (mm[0].start, 16) in prefill or any(n > 8 for _, n in prefill)
    finally:
        eng.close()


def test_a_prefix_cache_hit_inside_an_image_sees_the_whole_image(vision, engine):
    """A prompt cut one token after its image, run after the full prompt: its cached blocks end
    inside the image, so the step after the hit starts there; its tokens equal those of an
    engine without the prefix cache (and the last position's hidden state equals a one-step
    forward over the same cache: the next test)."""
    _, ids, mm = _prompt(vision, engine, "one_image")
    it = mm[0]
    cut = ids[: it.end + 1]
    boundary = (len(cut) - 1) // 16 * 16
    assert it.start < boundary < it.end  # the fixture's layout puts a block edge in the image
    cached = LLMEngine(str(TEXT), EngineArgs(max_num_seqs=1))
    plain = LLMEngine(str(TEXT), EngineArgs(max_num_seqs=1, enable_prefix_caching=False))
    try:
        run_greedy(cached, ids, mm, 2, rid="full")
        seen = _chunks(cached)
        ours, out = run_greedy(cached, cut, mm, 6, rid="cut")
        assert out.usage.cached_tokens == boundary and seen[0] == (boundary, len(cut) - boundary)
        want, _ = run_greedy(plain, cut, mm, 6, rid="cut")
        assert ours == want
    finally:
        cached.close()
        plain.close()


def test_a_step_starting_inside_an_image_matches_one_step(vision, engine):
    """Model level: the KV of a whole prompt computed in one step, then its tail recomputed from
    a position inside the image (as after a prefix-cache hit): the same hidden states."""
    _, ids, mm = _prompt(vision, engine, "one_image")
    it = mm[0]
    start = it.start + 5
    whole, kv = _forward(engine, ids, mm)
    tail = len(ids) - start
    rows = torch.tensor([p - start for p in it.positions if p >= start])
    values = it.encoder()[5:]
    meta = BatchMeta.contiguous(tail, len(ids), 16)
    meta = dataclasses.replace(meta, embeds=(rows, values))
    assert meta.embed_runs() == (((start, it.end),),)
    with torch.inference_mode():
        again = engine.model(torch.tensor(ids[start:]), torch.arange(start, len(ids)), meta, kv)
    torch.testing.assert_close(again, whole[start:], rtol=0, atol=1e-5)


def test_an_mmproj_of_another_model_is_refused(engine):
    from localllm.media.vision.mmproj import MMProjError

    with pytest.raises(MMProjError, match="belongs to another model"):
        VisionPipeline(DATA / "mmproj-idefics3.gguf", engine)
