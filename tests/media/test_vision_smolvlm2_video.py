"""SmolVLM2 video (frames as images through the idefics3 projector) against transformers fp32:
tests/data/vision/smolvlm2.json, recorded by tests/tools/record_smolvlm2_video_fixtures.py from a
tiny random-weight SmolVLM converted by llama.cpp's converter, on the Qwen fixtures' clip.mp4.

Tolerances: frame indices and pixel values equal (torch's antialiased Lanczos on uint8, as
torchvision); tower output within 1e-5 and logits within 1e-4 (measured 0.0 and ~1e-6);
prompt ids equal `SmolVLMProcessor`'s (intro, timestamps, frame tokens); greedy equal.
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
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.media.vision import video_smolvlm
from localllm.media.vision.pipeline import VisionPipeline
from tests.media.test_vision_qwen25vl import DATA
from tests.media.vision_fixture import run_greedy

TEXT = DATA / "smolvlm2-text.gguf"
MMPROJ = DATA / "mmproj-smolvlm2.gguf"
CLIP = DATA / "clip.mp4"


@cache
def record() -> dict:
    return json.loads((DATA / "smolvlm2.json").read_text())


def floats(b64: str, shape) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), dtype="<f4").reshape(shape)


@pytest.fixture(scope="module")
def engine():
    eng = LLMEngine(str(TEXT), EngineArgs(max_num_seqs=1))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def vision(engine):
    vp = VisionPipeline(MMPROJ, engine)
    p = record()["processor"]
    vp.processor.video_fps, vp.processor.video_size = p["video_fps"], p["video_size"]
    yield vp
    vp.close()


def test_frames_and_pixels_equal_the_hf_processor(vision):
    ref = record()["video"]
    assert (
        video_smolvlm.sample(8, ref["fps"], record()["processor"]["video_fps"], 64)
        == ref["frames_indices"]
    )
    item = vision.prepare_video(CLIP.read_bytes())
    assert item.video and item.layout.tiles == len(ref["frames_indices"])
    np.testing.assert_array_equal(
        item.pixels.numpy(), floats(ref["pixel_values"], ref["pixel_shape"])
    )
    out = vision.encode(item)
    want = floats(ref["image_features"], ref["feature_shape"])
    np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=1e-5)


def test_sampling_skips_the_ends_of_long_videos():
    # 10 min at 30 fps, 1 frame a second, at most 64: the first and last second are skipped
    idx = video_smolvlm.sample(18000, 30.0, 1.0, 64)
    assert len(idx) == 64 and idx[0] == 30 and idx[-1] == 17970


def test_prompt_ids_logits_and_greedy_match_transformers(vision, engine):
    chat = record()["video"]["chat"]
    item = vision.prepare_video(CLIP.read_bytes())
    ids, mm = vision.chat(engine, chat["messages"], [item])
    assert ids == chat["input_ids"]  # "...series of four frames from a 0:00:02 [H:MM:SS]..."
    full = ids + chat["greedy_ids"]
    m = engine.model
    layers, heads, hd = m.kv_shape()
    kv = PagedKVCache(layers, -(-len(full) // 16), 16, heads, hd, dtype="f32")
    rows = torch.tensor(mm[0].positions)
    batch = dataclasses.replace(
        BatchMeta.contiguous(len(full), len(full), 16), embeds=(rows, mm[0].encoder())
    )
    with torch.inference_mode():
        logits = m.logits(m(torch.tensor(full), torch.arange(len(full)), batch, kv)[len(ids) - 1 :])
    want = floats(chat["logits"], (-1, record()["vocab_size"]))
    np.testing.assert_allclose(logits.numpy()[: len(want)], want, rtol=0, atol=1e-4)
    ours, _ = run_greedy(engine, ids, mm, len(chat["greedy_ids"]))
    assert ours == chat["greedy_ids"]
