"""SmolVLM/Idefics3 against transformers fp32 (tests/data/vision, recorded by
tests/tools/record_vision_fixtures.py from a tiny random-weight model converted by llama.cpp's
`convert_hf_to_gguf.py` and `--mmproj`).

Tolerances: pixel values must be equal (same Pillow LANCZOS, same float ops); encoder outputs
within 1e-5 and logits within 1e-4 absolute (F16 weights widened to float32 on both sides: the
only differences are summation orders; measured 0.0 and 2.4e-6 on the 2-core CPU); greedy tokens
equal, or parting only at a near-tie of the reference (logit gap < 0.05).
"""

import dataclasses
import io

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from localllm.engine import EngineArgs, LLMEngine
from localllm.engine.core.batch import BatchMeta
from localllm.engine.runtime.kv_cache import PagedKVCache
from localllm.media.vision.pipeline import VisionPipeline
from tests.media.vision_fixture import (
    MMPROJ,
    TEXT,
    floats,
    image_bytes,
    record,
    rewrite_mmproj,
    run_greedy,
)

ENCODER_TOL = 1e-5
LOGIT_TOL = 1e-4
TIE = 0.05


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


@pytest.mark.parametrize("name", ["tall.png", "wide.png"])
def test_pixel_values_equal_the_hf_processor(vision, name):
    ref = record()["images"][name]
    img = vision.prepare(image_bytes(name))
    assert (img.layout.rows, img.layout.cols) == (ref["rows"], ref["cols"])
    want = floats(ref["pixel_values"], ref["pixel_shape"])
    np.testing.assert_array_equal(img.pixels.numpy(), want)


@pytest.mark.parametrize("name", ["tall.png", "wide.png"])
def test_encoder_output_matches_transformers(vision, name):
    ref = record()["images"][name]
    out = vision.encode(vision.prepare(image_bytes(name)))
    want = floats(ref["image_features"], ref["feature_shape"])
    assert tuple(out.shape) == tuple(want.shape)
    np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=ENCODER_TOL)


@pytest.mark.parametrize("name", ["one_image", "two_images"])
def test_prompt_ids_equal_the_hf_processor(vision, engine, name):
    chat, ids, mm = _prompt(vision, engine, name)
    assert ids == chat["input_ids"]
    token = record()["image_token_id"]
    assert [p for it in mm for p in it.positions] == [i for i, t in enumerate(ids) if t == token]


@pytest.mark.parametrize("name", ["one_image", "two_images"])
def test_logits_match_transformers(vision, engine, name):
    """Prompt + greedy tokens in one forward of the engine's model, images spliced in."""
    chat, ids, mm = _prompt(vision, engine, name)
    full = ids + chat["greedy_ids"]
    m = engine.model
    layers, heads, hd = m.kv_shape()
    kv = PagedKVCache(layers, -(-len(full) // 16), 16, heads, hd, dtype="f32")
    rows = torch.tensor([p for it in mm for p in it.positions])
    values = torch.cat([it.encoder() for it in mm])
    batch = BatchMeta.contiguous(len(full), len(full), 16)
    batch = dataclasses.replace(batch, embeds=(rows, values))
    with torch.inference_mode():
        hidden = m(torch.tensor(full), torch.arange(len(full)), batch, kv)
        logits = m.logits(hidden[len(ids) - 1 :]).numpy()
    want = floats(chat["logits"], (-1, record()["vocab_size"]))
    np.testing.assert_allclose(logits[: len(want)], want, rtol=0, atol=LOGIT_TOL)


@pytest.mark.parametrize("name", ["one_image", "two_images"])
def test_greedy_tokens_match_transformers(vision, engine, name):
    chat, ids, mm = _prompt(vision, engine, name)
    ours, _ = run_greedy(engine, ids, mm, len(chat["greedy_ids"]), rid=name)
    ref = chat["greedy_ids"]
    if ours != ref:  # only a near-tie of the reference may part them
        i = next(j for j, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b)
        step = floats(chat["logits"], (-1, record()["vocab_size"]))[i]
        assert abs(step[ours[i]] - step[ref[i]]) < TIE, f"step {i}: not a near-tie"


def test_chunked_prefill_splits_an_image_and_keeps_the_tokens(vision):
    """A 24-token step budget cuts the 80-token image span into pieces: same greedy tokens."""
    eng = LLMEngine(str(TEXT), EngineArgs(max_num_seqs=1, max_num_batched_tokens=24))
    try:
        chat, ids, mm = _prompt(vision, eng, "one_image")
        assert len(mm[0].positions) > 24
        ours, _ = run_greedy(eng, ids, mm, len(chat["greedy_ids"]))
        assert ours == chat["greedy_ids"]
    finally:
        eng.close()


def test_a_repeated_image_is_encoded_once_and_its_kv_reused(vision, engine):
    _, ids, mm = _prompt(vision, engine, "one_image")
    cache = engine.runner.encoder_cache
    misses = cache.misses
    first, _ = run_greedy(engine, ids, mm, 4, rid="again-1")
    _, ids2, mm2 = _prompt(vision, engine, "one_image")  # prepared anew: same content hash
    second, out = run_greedy(engine, ids2, mm2, 4, rid="again-2")
    assert second == first
    assert out.usage.cached_tokens >= (len(ids) - 1) // 16 * 16  # every full block was hit
    assert cache.misses <= misses + 1


def test_another_image_with_the_same_tokens_shares_no_kv_past_its_start(vision, engine):
    """tall.png and a flipped copy have the same layout, hence the same prompt ids: the prefix
    cache may serve the blocks before the image only, never the image's."""
    chat, ids, mm = _prompt(vision, engine, "one_image")
    run_greedy(engine, ids, mm, 2, rid="orig")
    buf = io.BytesIO()
    ImageOps.mirror(Image.open(io.BytesIO(image_bytes("tall.png")))).save(buf, "PNG")
    flipped = vision.prepare(buf.getvalue())
    ids2, mm2 = vision.chat(engine, chat["messages"], [flipped])
    assert ids2 == ids and mm2[0].content_hash != mm[0].content_hash
    _, out = run_greedy(engine, ids2, mm2, 2, rid="flipped")
    assert out.usage.cached_tokens <= mm[0].start


@pytest.mark.parametrize(("qtype", "tol"), [("Q8_0", 0.05), ("BF16", 0.05)])
def test_a_quantized_mmproj_keeps_its_type_and_stays_close(vision, tmp_path, qtype, tol):
    """Keep-quant: the tower's matrices stay in the file's type (no float copy at load), and
    its output stays near the F16 file's (Q8_0/BF16 rounding of the weights: measured max
    abs 0.031 / 0.010 on outputs of magnitude ~4)."""
    from gguf import GGMLQuantizationType

    from localllm.kernels.quant import QuantType
    from localllm.media.vision.mmproj import build_tower, open_mmproj

    path = rewrite_mmproj(tmp_path / "mm.gguf", qtype=GGMLQuantizationType[qtype])
    g = open_mmproj(path)
    try:
        model = build_tower(g)
        assert model.v.blk[0].attn_q.weight.qtype == QuantType[qtype]
        assert model.mm.model.fc.weight.qtype == QuantType[qtype]
        img = vision.prepare(image_bytes("tall.png"))
        with torch.inference_mode():
            got = model(img.pixels)
        want = vision.encode(img)
        assert (got - want).abs().max().item() < tol
    finally:
        g.close()
