"""SmolVLM/Idefics3 on CUDA (marked `gpu`): the tower on the GPU, images spliced into prompts
that the runner would otherwise replay through captured graphs, against transformers' record.

The GPU path keeps F16 weights in its own kernels and an f16 KV cache, and cuDNN may run the
patch convolution in TF32, so the encoder output is compared within 2e-2 of transformers' (its
values reach ~4) and greedy tokens must equal transformers' up to a near-tie.
"""

import pytest
import torch

from localllm.engine import EngineArgs, LLMEngine
from localllm.media.vision.pipeline import VisionPipeline
from tests.media.vision_fixture import MMPROJ, TEXT, floats, image_bytes, record, run_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
TIE = 0.05
ENCODER_TOL = 2e-2


def _check_greedy(ours, chat):
    ref = chat["greedy_ids"]
    if ours != ref:
        i = next(j for j, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b)
        step = floats(chat["logits"], (-1, record()["vocab_size"]))[i]
        assert abs(step[ours[i]] - step[ref[i]]) < TIE, f"step {i}: not a near-tie"


@pytest.mark.parametrize("budget", [512, 24])  # the whole prompt in one step; images cut up
def test_greedy_on_cuda_matches_transformers(budget):
    engine = LLMEngine(str(TEXT), EngineArgs(device="cuda", max_num_batched_tokens=budget))
    vision = VisionPipeline(MMPROJ, engine)
    try:
        assert vision.device.type == "cuda"
        for name, chat in record()["chats"].items():
            images = [vision.prepare(image_bytes(n)) for n in chat["images"]]
            ids, mm = vision.chat(engine, chat["messages"], images)
            ours, _ = run_greedy(engine, ids, mm, len(chat["greedy_ids"]), rid=f"{name}-{budget}")
            _check_greedy(ours, chat)
    finally:
        vision.close()
        engine.close()


def test_encoder_on_cuda_matches_the_record():
    engine = LLMEngine(str(TEXT), EngineArgs(device="cuda"))
    vision = VisionPipeline(MMPROJ, engine)
    try:
        for name, ref in record()["images"].items():
            out = vision.encode(vision.prepare(image_bytes(name))).float().cpu()
            want = torch.from_numpy(floats(ref["image_features"], ref["feature_shape"]).copy())
            assert (out - want).abs().max().item() < ENCODER_TOL
    finally:
        vision.close()
        engine.close()
