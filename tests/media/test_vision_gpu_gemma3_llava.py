"""Gemma 3 and LLaVA-1.5/1.6 vision on CUDA (marked `gpu`): the towers on the GPU, Gemma 3's image
spans through the CUDA prompt path (the dense attention fallback), against transformers'
records (tests/data/vision/*gemma3*, *llava*).

The GPU path keeps F16 weights in its own kernels (tensor-core GEMMs in float16, the SigLIP
blocks in float16 by default) and an f16 KV cache, and cuDNN may run the patch convolution in
TF32: encoder outputs within 2e-2 of transformers' and greedy tokens equal
up to a near-tie (logit gap < 0.05 in the reference), as the SmolVLM GPU test.
"""

import pytest
import torch

from localllm.engine import EngineArgs, LLMEngine
from localllm.kernels.attention import paged_attention
from localllm.kernels.quant import linear
from localllm.media.vision import mmproj as mmproj_loader
from localllm.media.vision.pipeline import VisionPipeline
from tests.media import test_vision_gemma3 as gemma3
from tests.media import test_vision_llava as llava
from tests.media.vision_fixture import floats, image_bytes, run_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
TIE = 0.05
ENCODER_TOL = 2e-2
# family -> (text GGUF, mmproj, record)
FAMILIES = {
    "gemma3": (gemma3.TEXT, gemma3.MMPROJ, gemma3.record()),
    "llava": (llava.TEXT, llava.MMPROJ, llava.record("1.5")),
    "llava16": (llava.TEXT, llava.DATA / "mmproj-llava16.gguf", llava.record("1.6")),
}


def _check_greedy(ours, chat, vocab):
    ref = chat["greedy_ids"]
    if ours != ref:
        i = next(j for j, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b)
        step = floats(chat["logits"], (-1, vocab))[i]
        assert abs(step[ours[i]] - step[ref[i]]) < TIE, f"step {i}: not a near-tie"


@pytest.mark.parametrize("budget", [512, 8])  # whole prompts; a budget smaller than an image
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_on_cuda_matches_transformers(family, budget):
    text, mmproj, rec = FAMILIES[family]
    engine = LLMEngine(str(text), EngineArgs(device="cuda", max_num_batched_tokens=budget))
    vision = VisionPipeline(mmproj, engine)
    try:
        assert vision.device.type == "cuda"
        for name, chat in rec["chats"].items():
            images = [vision.prepare(image_bytes(n)) for n in chat["images"]]
            ids, mm = vision.chat(engine, chat["messages"], images)
            ours, _ = run_greedy(engine, ids, mm, len(chat["greedy_ids"]), rid=f"{name}-{budget}")
            _check_greedy(ours, chat, rec["vocab_size"])
    finally:
        vision.close()
        engine.close()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_encoder_on_cuda_matches_the_record(family):
    text, mmproj, rec = FAMILIES[family]
    engine = LLMEngine(str(text), EngineArgs(device="cuda"))
    vision = VisionPipeline(mmproj, engine)
    try:
        for name, ref in rec["images"].items():
            out = vision.encode(vision.prepare(image_bytes(name))).float().cpu()
            want = torch.from_numpy(floats(ref["image_features"], ref["feature_shape"]).copy())
            assert (out - want).abs().max().item() < ENCODER_TOL
    finally:
        vision.close()
        engine.close()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, None])
def test_half_tower_on_cuda_matches_the_record(dtype, monkeypatch):
    """The SigLIP blocks on CUDA with `mmproj.HALF_TOWER` and `linear.HALF_GEMM` on: float16
    (then the default for this F16 mmproj: tensor-core matmuls, flash attention), bfloat16, and
    None (float32 blocks whose F16 linears still multiply in half, `half_gemm`), each within the
    encoder bound."""
    monkeypatch.setattr(mmproj_loader, "HALF_TOWER", True)
    monkeypatch.setattr(linear, "HALF_GEMM", True)
    text, mmproj, rec = FAMILIES["gemma3"]
    engine = LLMEngine(str(text), EngineArgs(device="cuda"))
    vision = VisionPipeline(mmproj, engine)
    try:
        blk = vision.model.v.blk[0]
        assert blk.half_weights["ffn_up"][0].dtype == torch.float16  # the CUDA default
        assert blk.ffn_up.kernels()[0].kind == "half_gemm"
        vision.model.v.use_half(dtype)
        for name, ref in rec["images"].items():
            out = vision.encode(vision.prepare(image_bytes(name))).float().cpu()
            want = torch.from_numpy(floats(ref["image_features"], ref["feature_shape"]).copy())
            assert (out - want).abs().max().item() < ENCODER_TOL
    finally:
        vision.close()
        engine.close()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_spans_on_cuda_match_the_reference(dtype):
    """The CUDA prompt path with spans (f16/bf16 caches read as stored) against the float64
    token-type reference of tests/kernels/test_paged_spans.py."""
    from tests.kernels.test_paged_attention import build
    from tests.kernels.test_paged_spans import CASES, reference

    seqs = tuple((n, t) for n, t, _ in CASES)
    spans = tuple(s for _, _, s in CASES)
    q, kc, vc, starts, lens, tables, qs, ks, vs = build(seqs, 16, 4, 2, 64, 64, seed=3)
    dev = torch.device("cuda")
    got = paged_attention(q.to(dev, dtype), kc.to(dev, dtype), vc.to(dev, dtype), starts, lens,
                          tables, 0.125, 6, spans=spans).float().cpu()  # fmt: skip
    for b, (qb, kb, vb) in enumerate(zip(qs, ks, vs, strict=True)):
        want = reference(qb.to(dtype), kb.to(dtype), vb.to(dtype), 0.125, spans[b], 6)
        err = (got[starts[b] : starts[b + 1]].double() - want).abs().max().item()
        assert err < 2e-2, f"sequence {b}: {err:.2e}"
