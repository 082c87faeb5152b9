"""Qwen2.5-VL (images and video) against transformers fp32 (tests/data/vision, recorded by
tests/tools/record_qwen_vl_fixtures.py from a tiny random-weight model converted by llama.cpp's
`convert_hf_to_gguf.py` and `--mmproj`).

Tolerances: pixel values equal (same Pillow BICUBIC / torch antialiased bicubic, same float
ops); encoder outputs within 1e-5 and logits within 1e-4 absolute (F16 weights widened to
float32 on both sides: measured 1.5e-6 and ~3e-6 on the 2-core CPU); M-RoPE positions equal
`get_rope_index`'s; greedy tokens equal, or parting only at a near-tie of the reference (logit
gap < 0.05).
"""

import base64
import dataclasses
import json
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch

from localllm.engine import EngineArgs, LLMEngine
from localllm.engine.core.batch import BatchMeta
from localllm.engine.multimodal import RopePositions
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.media.vision.mmproj import MMProjError
from localllm.media.vision.pipeline import VisionPipeline
from localllm.media.vision.qwen25vl_processor import Processor
from localllm.media.vision.video import VideoLimits, sample_indices
from tests.media.vision_fixture import TEXT as IDEFICS3_TEXT
from tests.media.vision_fixture import run_greedy

DATA = Path(__file__).resolve().parents[1] / "data" / "vision"
TEXT = DATA / "qwen25vl-text.gguf"
MMPROJ = DATA / "mmproj-qwen25vl.gguf"
ENCODER_TOL = 1e-5
LOGIT_TOL = 1e-4
TIE = 0.05


@cache
def record() -> dict:
    return json.loads((DATA / "qwen25vl.json").read_text())


def floats(b64: str, shape) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), dtype="<f4").reshape(shape)


def tiny_processor(vp: VisionPipeline) -> Processor:
    """The recorder's processor settings (smaller pixel bounds than Qwen's defaults)."""
    p = record()["processor"]
    lo, hi = p["min_pixels"], p["max_pixels"]
    return Processor(vp.model.args, lo, hi, lo, hi, p["tokens_per_second"])


def open_pipeline(engine) -> VisionPipeline:
    vp = VisionPipeline(MMPROJ, engine)
    vp.processor = tiny_processor(vp)
    return vp


@pytest.fixture(scope="module")
def engine():
    eng = LLMEngine(str(TEXT), EngineArgs(max_num_seqs=2))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def vision(engine):
    vp = open_pipeline(engine)
    yield vp
    vp.close()


def prepared(vision, name):
    data = (DATA / name).read_bytes()
    return vision.prepare_video(data) if name.endswith(".mp4") else vision.prepare(data)


def _prompt(vision, engine, name):
    chat = record()["chats"][name]
    items = [prepared(vision, n) for n in chat["images"] + chat["videos"]]
    ids, mm = vision.chat(engine, chat["messages"], items)
    return chat, ids, mm


@pytest.mark.parametrize("name", ["qtall.png", "qwide.png", "clip.mp4"])
def test_pixel_values_equal_the_hf_processor(vision, name):
    ref = record()["visuals"][name]
    item = prepared(vision, name)
    assert list(item.layout.thw) == ref["grid_thw"]
    np.testing.assert_array_equal(
        item.pixels.numpy(), floats(ref["pixel_values"], ref["pixel_shape"])
    )


@pytest.mark.parametrize("name", ["qtall.png", "qwide.png", "clip.mp4"])
def test_encoder_output_matches_transformers(vision, name):
    ref = record()["visuals"][name]
    out = vision.encode(prepared(vision, name))
    want = floats(ref["image_features"], ref["feature_shape"])
    assert tuple(out.shape) == tuple(want.shape)
    np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=ENCODER_TOL)


def test_video_frames_are_sampled_as_the_hf_processor_does():
    ref = record()["visuals"]["clip.mp4"]
    limits = VideoLimits(fps=record()["processor"]["video_fps"])
    assert sample_indices(8, ref["fps"], limits, 2) == ref["frames_indices"]
    # fps sampling, min and max frames, rounding down to whole temporal patches
    assert len(sample_indices(300, 30.0, VideoLimits(fps=2.0), 2)) == 20
    assert len(sample_indices(30, 30.0, VideoLimits(fps=2.0), 2)) == 4  # min_frames
    assert len(sample_indices(30000, 30.0, VideoLimits(fps=2.0, max_frames=64), 2)) == 64


@pytest.mark.parametrize("name", ["one_image", "two_images", "video"])
def test_prompt_ids_and_mrope_positions_equal_transformers(vision, engine, name):
    chat, ids, mm = _prompt(vision, engine, name)
    assert ids == chat["input_ids"]
    rope = RopePositions.of(mm, len(ids))
    assert rope.table.tolist() == chat["positions"]
    assert rope.delta == chat["delta"]


@pytest.mark.parametrize("name", ["one_image", "two_images", "video"])
def test_logits_match_transformers(vision, engine, name):
    """Prompt + greedy tokens in one forward of the engine's model with M-RoPE positions."""
    chat, ids, mm = _prompt(vision, engine, name)
    full = ids + chat["greedy_ids"]
    m = engine.model
    layers, heads, hd = m.kv_shape()
    kv = PagedKVCache(layers, -(-len(full) // 16), 16, heads, hd, dtype="f32")
    rows = torch.tensor([p for it in mm for p in it.positions])
    values = torch.cat([it.encoder() for it in mm])
    batch = BatchMeta.contiguous(len(full), len(full), 16)
    batch = dataclasses.replace(batch, embeds=(rows, values))
    positions = RopePositions.of(mm, len(ids)).rows(0, len(full))
    with torch.inference_mode():
        hidden = m(torch.tensor(full), positions, batch, kv)
        logits = m.logits(hidden[len(ids) - 1 :]).numpy()
    want = floats(chat["logits"], (-1, record()["vocab_size"]))
    np.testing.assert_allclose(logits[: len(want)], want, rtol=0, atol=LOGIT_TOL)


def _check_greedy(ours, chat):
    ref = chat["greedy_ids"]
    if ours != ref:  # only a near-tie of the reference may part them
        i = next(j for j, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b)
        step = floats(chat["logits"], (-1, record()["vocab_size"]))[i]
        assert abs(step[ours[i]] - step[ref[i]]) < TIE, f"step {i}: not a near-tie"


@pytest.mark.parametrize("name", ["one_image", "two_images", "video"])
def test_greedy_tokens_match_transformers(vision, engine, name):
    chat, ids, mm = _prompt(vision, engine, name)
    ours, _ = run_greedy(engine, ids, mm, len(chat["greedy_ids"]), rid=name)
    _check_greedy(ours, chat)


@pytest.mark.parametrize("budget", [8, 13])
def test_chunked_prefill_splits_the_images_and_keeps_the_tokens(budget):
    """A small step budget cuts the 30- and 36-token image spans (and the text after them,
    whose positions are shifted) into pieces: the same greedy tokens."""
    eng = LLMEngine(str(TEXT), EngineArgs(max_num_seqs=1, max_num_batched_tokens=budget))
    vp = open_pipeline(eng)
    try:
        chat, ids, mm = _prompt(vp, eng, "two_images")
        assert all(len(it.positions) > budget for it in mm)
        ours, _ = run_greedy(eng, ids, mm, len(chat["greedy_ids"]))
        _check_greedy(ours, chat)
    finally:
        vp.close()
        eng.close()


def test_a_repeated_prompt_reuses_its_kv_and_decodes_the_same(vision, engine):
    """Prefix-cache blocks past an image carry its shifted positions: a hit must decode the
    same tokens as the first run."""
    chat, ids, mm = _prompt(vision, engine, "two_images")
    first, _ = run_greedy(engine, ids, mm, 6, rid="rep-1")
    _, ids2, mm2 = _prompt(vision, engine, "two_images")
    second, out = run_greedy(engine, ids2, mm2, 6, rid="rep-2")
    assert second == first == chat["greedy_ids"][:6]
    assert out.usage.cached_tokens >= (len(ids) - 1) // 16 * 16


def test_two_requests_in_one_batch_decode_as_alone(vision, engine):
    """A video request and a text-only one share steps ([3, T] positions for the batch)."""
    from localllm.engine import SamplingParams

    chat, ids, mm = _prompt(vision, engine, "video")
    text_ids = engine.tokenize("user assistant Numbers 1 2 3")
    alone, _ = run_greedy(engine, text_ids, (), 6, rid="text-alone")
    params = SamplingParams(temperature=0, max_tokens=len(chat["greedy_ids"]))
    engine.add_request("v", ids, params, mm_inputs=mm)
    engine.add_request("t", text_ids, SamplingParams(temperature=0, max_tokens=6))
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = list(o.outputs[0].token_ids)
    assert outs["t"] == alone
    _check_greedy(outs["v"], chat)


def test_a_qwen_projector_is_refused_for_a_model_without_mrope():
    eng = LLMEngine(str(IDEFICS3_TEXT), EngineArgs(max_num_seqs=1))
    try:
        with pytest.raises(MMProjError, match="M-RoPE"):
            VisionPipeline(MMPROJ, eng)
    finally:
        eng.close()


def test_a_projector_without_video_support_says_so():
    from localllm.media.vision.video import VideoError

    eng = LLMEngine(str(DATA / "llava-text.gguf"), EngineArgs(max_num_seqs=1))
    vp = VisionPipeline(DATA / "mmproj-llava.gguf", eng)
    try:
        with pytest.raises(VideoError, match="does not take video"):
            vp.prepare_video((DATA / "clip.mp4").read_bytes())
    finally:
        vp.close()
        eng.close()


@pytest.mark.parametrize(("t", "h", "w"), [(1, 12, 10), (2, 6, 24), (1, 20, 20)])
def test_grouped_attention_equals_the_masked_reference(t, h, w):
    """`Groups.attend` (windows or frames batched, ragged ones padded) against one SDPA call
    over all patches with the block mask it stands for."""
    from localllm.media.vision.qwen25vl import Groups, _patch_grid

    torch.manual_seed(0)
    _, _, frame, window = _patch_grid(t, h, w, 4)
    q, k, v = (torch.randn(2, t * h * w, 8) for _ in range(3))
    for ids in (frame, window):
        mask = ids[:, None] == ids[None, :]
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        got = Groups.of(ids).attend(q, k, v)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
