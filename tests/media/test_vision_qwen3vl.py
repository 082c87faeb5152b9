"""Qwen3-VL and Qwen3-VL-MoE (images and video) against transformers fp32 (tests/data/vision,
recorded by tests/tools/record_qwen3_vl_fixtures.py, with and without `--moe`, from tiny
random-weight models converted by llama.cpp's `convert_hf_to_gguf.py` and `--mmproj`):
deepstack, interleaved M-RoPE, the learned positions resampled to each grid, and videos as
timestamped temporal patches.

Tolerances as tests/media/test_vision_qwen25vl.py: pixels equal, the tower's output (main and
deepstack parts) within 1e-5 (measured 2.1e-6), logits within 1e-4, M-RoPE positions equal,
greedy equal up to a near-tie of the reference.
"""

import base64
import dataclasses
import json
from functools import cache

import numpy as np
import pytest
import torch

from localllm.engine import EngineArgs, LLMEngine
from localllm.engine.core.batch import BatchMeta
from localllm.engine.multimodal import RopePositions
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.media.vision.pipeline import VisionPipeline
from localllm.media.vision.qwen3vl_processor import Processor
from localllm.media.vision.video import VideoLimits, sample_linspace
from tests.media.test_vision_qwen25vl import DATA
from tests.media.vision_fixture import run_greedy

FAMILIES = ["qwen3vl", "qwen3vlmoe"]
TEXT = DATA / "qwen3vl-text.gguf"
ENCODER_TOL = 1e-5
LOGIT_TOL = 1e-4
TIE = 0.05
CHATS = ["one_image", "two_images", "video"]


@cache
def record(family: str = "qwen3vl") -> dict:
    return json.loads((DATA / f"{family}.json").read_text())


def floats(b64: str, shape) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), dtype="<f4").reshape(shape)


def open_pipeline(engine, family: str = "qwen3vl") -> VisionPipeline:
    vp = VisionPipeline(DATA / f"mmproj-{family}.gguf", engine)
    vp.family = family
    p = record(family)["processor"]
    vp.processor = Processor(vp.model.args, p["min_pixels"], p["max_pixels"],
                             p["video_min_pixels"], p["video_max_pixels"])  # fmt: skip
    return vp


@pytest.fixture(scope="module", params=FAMILIES)
def engine(request):
    eng = LLMEngine(str(DATA / f"{request.param}-text.gguf"), EngineArgs(max_num_seqs=2))
    eng.family = request.param
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def vision(engine):
    vp = open_pipeline(engine, engine.family)
    yield vp
    vp.close()


def prepared(vision, name):
    data = (DATA / name).read_bytes()
    return vision.prepare_video(data) if name.endswith(".mp4") else vision.prepare(data)


def _prompt(vision, engine, name):
    chat = record(vision.family)["chats"][name]
    items = [prepared(vision, n) for n in chat["images"] + chat["videos"]]
    ids, mm = vision.chat(engine, chat["messages"], items)
    return chat, ids, mm


def _check_greedy(ours, chat):
    ref = chat["greedy_ids"]
    if ours != ref:  # only a near-tie of the reference may part them
        i = next(j for j, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b)
        step = floats(chat["logits"], (-1, record()["vocab_size"]))[i]  # (one tokenizer)
        assert abs(step[ours[i]] - step[ref[i]]) < TIE, f"step {i}: not a near-tie"


@pytest.mark.parametrize("name", ["qtall.png", "qwide.png", "clip.mp4"])
def test_pixels_and_tower_output_match_transformers(vision, name):
    ref = record(vision.family)["visuals"][name]
    item = prepared(vision, name)
    assert list(item.layout.thw) == ref["grid_thw"]
    want = floats(ref["pixel_values"], ref["pixel_shape"])
    np.testing.assert_array_equal(item.pixels.numpy(), want)
    out = vision.encode(item)
    want = floats(ref["image_features"], ref["feature_shape"])  # main + 2 deepstack parts
    assert tuple(out.shape) == tuple(want.shape)
    np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=ENCODER_TOL)


def test_video_frames_and_timestamps_are_the_hf_processors(vision):
    ref = record(vision.family)["visuals"]["clip.mp4"]
    limits = VideoLimits(fps=record()["processor"]["video_fps"])
    assert sample_linspace(8, ref["fps"], limits) == ref["frames_indices"]
    assert list(prepared(vision, "clip.mp4").layout.stamps) == ref["timestamps"]


@pytest.mark.parametrize("name", CHATS)
def test_prompt_ids_and_mrope_positions_equal_transformers(vision, engine, name):
    chat, ids, mm = _prompt(vision, engine, name)
    assert ids == chat["input_ids"]  # a video: "<0.2 seconds>" before each temporal patch
    rope = RopePositions.of(mm, len(ids))
    assert rope.table.tolist() == chat["positions"]
    assert rope.delta == chat["delta"]


@pytest.mark.parametrize("name", CHATS)
def test_logits_match_transformers(vision, engine, name):
    chat, ids, mm = _prompt(vision, engine, name)
    full = ids + chat["greedy_ids"]
    m = engine.model
    layers, heads, hd = m.kv_shape()
    kv = PagedKVCache(layers, -(-len(full) // 16), 16, heads, hd, dtype="f32")
    rows = torch.tensor([p for it in mm for p in it.positions])
    values = torch.cat([it.encoder() for it in mm])
    batch = dataclasses.replace(
        BatchMeta.contiguous(len(full), len(full), 16), embeds=(rows, values)
    )
    positions = RopePositions.of(mm, len(ids)).rows(0, len(full))
    with torch.inference_mode():
        logits = m.logits(m(torch.tensor(full), positions, batch, kv)[len(ids) - 1 :]).numpy()
    want = floats(chat["logits"], (-1, record()["vocab_size"]))
    np.testing.assert_allclose(logits[: len(want)], want, rtol=0, atol=LOGIT_TOL)


@pytest.mark.parametrize("name", CHATS)
def test_greedy_tokens_match_transformers(vision, engine, name):
    chat, ids, mm = _prompt(vision, engine, name)
    ours, _ = run_greedy(engine, ids, mm, len(chat["greedy_ids"]), rid=name)
    _check_greedy(ours, chat)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", ["two_images", "video"])
def test_chunked_prefill_keeps_the_tokens(name, family):
    """7-token steps split the images and the video's segments (and their deepstack rows)."""
    text = DATA / f"{family}-text.gguf"
    eng = LLMEngine(str(text), EngineArgs(max_num_seqs=1, max_num_batched_tokens=7))
    vp = open_pipeline(eng, family)
    try:
        chat, ids, mm = _prompt(vp, eng, name)
        ours, _ = run_greedy(eng, ids, mm, len(chat["greedy_ids"]))
        _check_greedy(ours, chat)
    finally:
        vp.close()
        eng.close()


def test_an_odd_frame_count_pads_the_last_temporal_patch(vision):
    """5 sampled frames: the last temporal patch repeats the last frame, and its time is that
    frame's (transformers' `_calculate_timestamps` on the same indices)."""
    from transformers import Qwen3VLProcessor

    from localllm.media.vision.video import decode_video

    v = decode_video((DATA / "clip.mp4").read_bytes(), sampler=lambda n, f, lim: [0, 2, 3, 5, 7])
    pixels, grid = vision.processor.preprocess_video(v)
    want = Qwen3VLProcessor._calculate_timestamps(None, list(v.indices), v.fps, 2)
    assert grid.t == 3 and list(grid.stamps) == want
    per_patch = pixels.reshape(3, grid.h * grid.w, 3, 2, -1)  # (C, T, p*p) per patch
    np.testing.assert_array_equal(per_patch[2, :, :, 0], per_patch[2, :, :, 1])
