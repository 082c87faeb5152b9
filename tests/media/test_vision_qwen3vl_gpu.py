"""Qwen3-VL on CUDA (marked `gpu`): the tower (with deepstack) on the GPU, deepstack rows added in
the eager prefill steps, decode through the shifted decode graphs, against transformers' record
(tests/data/vision/qwen3vl.json). Tolerances as tests/media/test_vision_qwen25vl_gpu.py."""

import pytest
import torch

from localllm.engine import EngineArgs, LLMEngine
from tests.media.test_vision_qwen3vl import (
    DATA,
    FAMILIES,
    _check_greedy,
    _prompt,
    floats,
    open_pipeline,
    prepared,
    record,
)
from tests.media.vision_fixture import run_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
ENCODER_TOL = 2e-2


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("budget", [512, 7])
def test_greedy_on_cuda_matches_transformers(budget, family):
    text = str(DATA / f"{family}-text.gguf")
    engine = LLMEngine(text, EngineArgs(device="cuda", max_num_batched_tokens=budget))
    vision = open_pipeline(engine, family)
    try:
        for name, chat in record(family)["chats"].items():
            _, ids, mm = _prompt(vision, engine, name)
            ours, _ = run_greedy(engine, ids, mm, len(chat["greedy_ids"]), rid=f"{name}-{budget}")
            _check_greedy(ours, chat)
    finally:
        vision.close()
        engine.close()


def test_encoder_on_cuda_matches_the_record():
    engine = LLMEngine(str(DATA / "qwen3vl-text.gguf"), EngineArgs(device="cuda"))
    vision = open_pipeline(engine)
    try:
        for name, ref in record()["visuals"].items():
            out = vision.encode(prepared(vision, name)).float().cpu()
            want = torch.from_numpy(floats(ref["image_features"], ref["feature_shape"]).copy())
            assert (out - want).abs().max().item() < ENCODER_TOL
    finally:
        vision.close()
        engine.close()
