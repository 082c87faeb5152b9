"""LLaVA-1.5 and LLaVA-1.6 (CLIP tower + `mlp` projector) against transformers fp32
(tests/data/vision/*llava*, recorded by tests/tools/record_llava_fixtures.py from a tiny
random-weight LlavaForConditionalGeneration, and the same weights in a
LlavaNextForConditionalGeneration with an image newline and grid pinpoints, converted as
llama.cpp converts them: the text model by `convert_hf_to_gguf.py`, the tower and projector by
its legacy `convert_image_encoder_to_gguf.py`).

Tolerances: pixel values equal (same Pillow BICUBIC, crop and padding, same float ops; for 1.6
every tile: tall.png takes a 2 x 2 grid, wide.png 1 x 3); encoder outputs within 1e-5 and logits
within 1e-4 absolute (measured 0.0 and under 3e-6 on the 2-core CPU); greedy tokens equal.
"""

import json
from functools import cache

import numpy as np
import pytest
import torch

from localllm.engine import EngineArgs, LLMEngine
from localllm.media.vision.mmproj import MMProjError
from localllm.media.vision.pipeline import VisionPipeline
from tests.media.vision_fixture import DATA, floats, image_bytes, run_greedy

TEXT = DATA / "llava-text.gguf"  # one text model: the 1.6 fixture reuses the 1.5 weights
MMPROJ = DATA / "mmproj-llava.gguf"
ENCODER_TOL = 1e-5
LOGIT_TOL = 1e-4
VERSIONS = ["1.5", "1.6"]


@cache
def record(version: str = "1.5") -> dict:
    return json.loads((DATA / ("llava.json" if version == "1.5" else "llava16.json")).read_text())


@pytest.fixture(scope="module")
def engine():
    eng = LLMEngine(str(TEXT), EngineArgs(max_num_seqs=2))
    yield eng
    eng.close()


@pytest.fixture(scope="module", params=VERSIONS)
def version(request):
    return request.param


@pytest.fixture(scope="module")
def vision(engine, version):
    vp = VisionPipeline(MMPROJ if version == "1.5" else DATA / "mmproj-llava16.gguf", engine)
    vp.version = version
    yield vp
    vp.close()


def _prompt(vision, engine, name):
    chat = record(vision.version)["chats"][name]
    images = [vision.prepare(image_bytes(n)) for n in chat["images"]]
    ids, mm = vision.chat(engine, chat["messages"], images)
    return chat, ids, mm


@pytest.mark.parametrize("name", ["tall.png", "wide.png"])
def test_pixel_values_equal_the_hf_processor(vision, name):
    ref = record(vision.version)["images"][name]
    img = vision.prepare(image_bytes(name))
    want = floats(ref["pixel_values"], ref["pixel_shape"])
    np.testing.assert_array_equal(img.pixels.numpy(), want)


@pytest.mark.parametrize("name", ["tall.png", "wide.png"])
def test_encoder_output_matches_transformers(vision, name):
    ref = record(vision.version)["images"][name]
    out = vision.encode(vision.prepare(image_bytes(name)))
    want = floats(ref["image_features"], ref["feature_shape"])
    assert tuple(out.shape) == tuple(want.shape)
    np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=ENCODER_TOL)


def test_the_legacy_file_names_the_first_mlp_matrix_ffn_down(vision):
    """llama.cpp's legacy converter swaps the MLP names: the file's `ffn_down` is the
    widening matrix, and the block takes it first (the encoder test above proves the result)."""
    blk = vision.model.v.blk[0]
    hidden = vision.model.args.tower.hidden_dim
    assert blk.ffn_down.out_features == hidden and blk.ffn_up.in_features == hidden


@pytest.mark.parametrize("name", ["one_image", "two_images"])
def test_prompt_ids_equal_the_hf_processor(vision, engine, name):
    chat, ids, mm = _prompt(vision, engine, name)
    assert ids == chat["input_ids"]
    token = record(vision.version)["image_token_id"]
    assert [p for it in mm for p in it.positions] == [i for i, t in enumerate(ids) if t == token]


@pytest.mark.parametrize("name", ["one_image", "two_images"])
def test_logits_match_transformers(vision, engine, name):
    import dataclasses

    from localllm.engine.core.batch import BatchMeta
    from localllm.engine.runtime.kv_cache import PagedKVCache

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
        logits = m.logits(m(torch.tensor(full), torch.arange(len(full)), batch, kv)).numpy()
    want = floats(chat["logits"], (-1, record(vision.version)["vocab_size"]))
    got = logits[len(ids) - 1 :][: len(want)]
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_TOL)


@pytest.mark.parametrize("name", ["one_image", "two_images"])
def test_greedy_tokens_match_transformers(vision, engine, name):
    chat, ids, mm = _prompt(vision, engine, name)
    ours, _ = run_greedy(engine, ids, mm, len(chat["greedy_ids"]), rid=name)
    assert ours == chat["greedy_ids"]


def _with_metadata(dst, **extra) -> str:
    """The fixture mmproj written again with `extra` metadata (key -> list of ints)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(str(MMPROJ))
    w = GGUFWriter(str(dst), "clip")
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), kind, sub_type=sub)
    for key, value in extra.items():
        w.add_array(key, value)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(dst)


def test_llava_16_tiles_and_token_counts(vision):
    """The grid and the token count of each image are transformers' (the layout test of the
    packed features; their values are the encoder test's)."""
    if vision.version == "1.5":
        assert vision.prepare(image_bytes("tall.png")).layout is None
        return
    for name, grid in (("tall.png", (2, 2)), ("wide.png", (1, 3))):
        img = vision.prepare(image_bytes(name))
        ref = record("1.6")["images"][name]
        assert (img.layout.rows, img.layout.cols) == grid
        assert [img.layout.height, img.layout.width] == ref["image_size"]
        assert img.num_tokens == ref["feature_shape"][0]


@pytest.mark.parametrize("pinpoints", [[32, 48], [32], [16, 32], [320, 320]])
def test_bad_grid_pinpoints_are_refused(engine, tmp_path, pinpoints):
    """Not a multiple of the 32-px tile, an odd count, smaller than a tile, 100 tiles."""
    path = _with_metadata(tmp_path / "bad.gguf", **{"clip.vision.image_grid_pinpoints": pinpoints})
    with pytest.raises(MMProjError, match="image_grid_pinpoints"):
        VisionPipeline(path, engine)


def test_features_from_several_layers_are_refused(engine, tmp_path):
    path = _with_metadata(tmp_path / "multi.gguf", **{"clip.vision.feature_layer": [1, 2]})
    with pytest.raises(MMProjError, match="several layers"):
        VisionPipeline(path, engine)


def test_llava_15_and_16_hash_the_same_image_apart(engine):
    """Their embeddings of one picture differ (base view only vs tiles): the encoder and prefix
    caches must never hand one's to the other (they did, when the hash ignored the grid)."""
    a = VisionPipeline(MMPROJ, engine)
    b = VisionPipeline(DATA / "mmproj-llava16.gguf", engine)
    try:
        ia, ib = a.prepare(image_bytes("tall.png")), b.prepare(image_bytes("tall.png"))
        assert ia.digest != ib.digest and ia.num_tokens != ib.num_tokens
    finally:
        a.close()
        b.close()
