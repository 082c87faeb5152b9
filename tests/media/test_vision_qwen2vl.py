"""Qwen2-VL (images and video) against transformers fp32: tests/data/vision/qwen2vl.json, from
`tests/tools/record_qwen_vl_fixtures.py --qwen2` (a tiny random-weight Qwen2-VL converted by
llama.cpp's converter, the Qwen2.5-VL fixtures' images and video). Tolerances as
tests/media/test_vision_qwen25vl.py (measured: tower 1.2e-6)."""

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
from localllm.media.vision.qwen2vl_processor import Processor
from tests.media.test_vision_qwen25vl import DATA
from tests.media.vision_fixture import run_greedy

TEXT = DATA / "qwen2vl-text.gguf"
MMPROJ = DATA / "mmproj-qwen2vl.gguf"
CHATS = ["one_image", "two_images", "video"]


@cache
def record() -> dict:
    return json.loads((DATA / "qwen2vl.json").read_text())


def floats(b64: str, shape) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), dtype="<f4").reshape(shape)


def open_pipeline(engine) -> VisionPipeline:
    vp = VisionPipeline(MMPROJ, engine)
    p = record()["processor"]
    lo, hi = p["min_pixels"], p["max_pixels"]
    vp.processor = Processor(vp.model.args, lo, hi, lo, hi)
    return vp


@pytest.fixture(scope="module")
def engine():
    eng = LLMEngine(str(TEXT), EngineArgs(max_num_seqs=1))
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
    return chat, *vision.chat(engine, chat["messages"], items)


@pytest.mark.parametrize("name", ["qtall.png", "qwide.png", "clip.mp4"])
def test_pixels_and_tower_output_match_transformers(vision, name):
    ref = record()["visuals"][name]
    item = prepared(vision, name)
    np.testing.assert_array_equal(
        item.pixels.numpy(), floats(ref["pixel_values"], ref["pixel_shape"])
    )
    out = vision.encode(item)
    want = floats(ref["image_features"], ref["feature_shape"])
    np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", CHATS)
def test_ids_positions_logits_and_greedy_match_transformers(vision, engine, name):
    chat, ids, mm = _prompt(vision, engine, name)
    assert ids == chat["input_ids"]
    rope = RopePositions.of(mm, len(ids))
    assert rope.table.tolist() == chat["positions"] and rope.delta == chat["delta"]
    full = ids + chat["greedy_ids"]
    m = engine.model
    layers, heads, hd = m.kv_shape()
    kv = PagedKVCache(layers, -(-len(full) // 16), 16, heads, hd, dtype="f32")
    rows = torch.tensor([p for it in mm for p in it.positions])
    values = torch.cat([it.encoder() for it in mm])
    batch = dataclasses.replace(
        BatchMeta.contiguous(len(full), len(full), 16), embeds=(rows, values)
    )
    with torch.inference_mode():
        out = m(torch.tensor(full), rope.rows(0, len(full)), batch, kv)
        logits = m.logits(out[len(ids) - 1 :]).numpy()
    want = floats(chat["logits"], (-1, record()["vocab_size"]))
    np.testing.assert_allclose(logits[: len(want)], want, rtol=0, atol=1e-4)
    ours, _ = run_greedy(engine, ids, mm, len(chat["greedy_ids"]), rid=name)
    assert ours == chat["greedy_ids"]


def test_chunked_prefill_keeps_the_tokens():
    eng = LLMEngine(str(TEXT), EngineArgs(max_num_seqs=1, max_num_batched_tokens=9))
    vp = open_pipeline(eng)
    try:
        chat, ids, mm = _prompt(vp, eng, "two_images")
        ours, _ = run_greedy(eng, ids, mm, len(chat["greedy_ids"]))
        assert ours == chat["greedy_ids"]
    finally:
        vp.close()
        eng.close()
