"""tests/perf/make_synthetic_vlm_big.py writes what llama.cpp's converter writes, at small sizes:
the mmproj's `clip.*` keys and tensor names (and F16/F32 types) equal those of the converted
fixtures tests/data/vision/mmproj-{gemma3,qwen25vl}.gguf, the text model's keys and tensor names
those of {gemma3,qwen25vl}-text.gguf; and localllm loads each pair and answers an image prompt."""

import dataclasses

import gguf
import pytest
import torch

from localllm.engine import EngineArgs, LLMEngine, SamplingParams
from localllm.media.vision.pipeline import VisionPipeline
from tests.media.vision_fixture import DATA, image_bytes
from tests.perf import make_synthetic_vlm_big as big

FIXTURES = {"gemma3-4b": "gemma3", "qwen25vl-7b": "qwen25vl"}
# keys only the synthetic Qwen mmproj has: the model's pixel bounds (see the maker's docstring)
EXTRA = {"clip.vision.image_min_pixels", "clip.vision.image_max_pixels"}


def _small(shape: str) -> big.Pair:
    """The shape with the fixture's block counts and small widths (K-quant rows of 256)."""
    ref_text = gguf.GGUFReader(DATA / f"{FIXTURES[shape]}-text.gguf")
    ref_mm = gguf.GGUFReader(DATA / f"mmproj-{FIXTURES[shape]}.gguf")
    arch = ref_text.fields["general.architecture"].contents()
    layers = ref_text.fields[f"{arch}.block_count"].contents()
    s = big.SHAPES[shape]
    return dataclasses.replace(
        s, layers=layers, dim=256, heads=2, kv_heads=1, head_dim=128, ffn=256, vocab=400,
        v_layers=ref_mm.fields["clip.vision.block_count"].contents(), v_dim=32, v_heads=2,
        v_ffn=64, image_size=32 if s.projector == "gemma3" else 56,
        patch=4 if s.projector == "gemma3" else 14,
    )  # fmt: skip


@pytest.fixture(scope="module", params=sorted(FIXTURES))
def pair(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("vlm-big")
    s = _small(request.param)
    text, mm = out / "text.gguf", out / "mmproj.gguf"
    big.write_text(text, s, 0)
    big.write_mmproj(mm, s, 1)
    return request.param, text, mm


def _keys(path, prefix: str) -> set[str]:
    return {k for k in gguf.GGUFReader(path).fields if k.startswith(prefix)}


def test_keys_and_tensors_are_the_converters(pair):
    shape, text, mm = pair
    name = FIXTURES[shape]
    ref_mm = DATA / f"mmproj-{name}.gguf"
    assert _keys(mm, "clip.") - EXTRA == _keys(ref_mm, "clip.")
    ref, ours = gguf.GGUFReader(ref_mm), gguf.GGUFReader(mm)
    for key in ("general.architecture", "general.type", "clip.projector_type"):
        assert ours.fields[key].contents() == ref.fields[key].contents()
    assert {t.name: t.tensor_type for t in ours.tensors} == {
        t.name: t.tensor_type for t in ref.tensors
    }
    ref_text = DATA / f"{name}-text.gguf"
    arch = gguf.GGUFReader(ref_text).fields["general.architecture"].contents()
    assert _keys(text, arch + ".") == _keys(ref_text, arch + ".")
    # the converter's F16 text file against our Q4_K_M one: the same names
    assert {t.name for t in gguf.GGUFReader(text).tensors} == {
        t.name for t in gguf.GGUFReader(ref_text).tensors
    }


def test_localllm_loads_the_pair_and_answers(pair):
    _, text, mm = pair
    engine = LLMEngine(str(text), EngineArgs(max_num_seqs=1, max_model_len=1024))
    pipe = VisionPipeline(mm, engine)
    try:
        im = pipe.prepare(image_bytes("wide.png"))
        emb = pipe.encode(im)
        assert emb.shape == (im.num_tokens, 256) and torch.isfinite(emb).all()
        turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
        ids, items = pipe.chat(engine, turn, [im])
        engine.add_request("r", ids, SamplingParams(temperature=0, max_tokens=2), mm_inputs=items)
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        assert outs[-1].error is None and len(outs[-1].outputs[0].token_ids) == 2
    finally:
        pipe.close()
        engine.close()
