"""Qwen2.5-VL on CUDA (marked `gpu`): the tower on the GPU, M-RoPE prompts through the runner's
eager steps and its decode graphs (the rope shift column of `pack_decode`), against
transformers' record (tests/data/vision/qwen25vl.json).

The GPU path keeps F16 weights in its own kernels and an f16 KV cache, and TF32 may run the
patch matmul, so the tower output is compared within 2e-2 of transformers' and greedy tokens must
equal transformers' up to a near-tie.
"""

import pytest
import torch

from localllm.engine import EngineArgs, LLMEngine, SamplingParams
from tests.media.test_vision_qwen25vl import (
    TEXT,
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


@pytest.mark.parametrize("budget", [512, 8])  # the whole prompt in one step; images cut up
def test_greedy_on_cuda_matches_transformers(budget):
    engine = LLMEngine(str(TEXT), EngineArgs(device="cuda", max_num_batched_tokens=budget))
    vision = open_pipeline(engine)
    try:
        assert vision.device.type == "cuda"
        assert engine.runner.graphs is not None  # decode steps replay graphs, shifted
        for name, chat in record()["chats"].items():
            _, ids, mm = _prompt(vision, engine, name)
            ours, _ = run_greedy(engine, ids, mm, len(chat["greedy_ids"]), rid=f"{name}-{budget}")
            _check_greedy(ours, chat)
    finally:
        vision.close()
        engine.close()


def test_a_video_and_a_text_request_decode_together_on_cuda():
    engine = LLMEngine(str(TEXT), EngineArgs(device="cuda", max_num_seqs=2))
    vision = open_pipeline(engine)
    try:
        chat, ids, mm = _prompt(vision, engine, "video")
        text_ids = engine.tokenize("user assistant Numbers 1 2 3")
        alone, _ = run_greedy(engine, text_ids, (), 6, rid="alone")
        n = len(chat["greedy_ids"])
        engine.add_request("v", ids, SamplingParams(temperature=0, max_tokens=n), mm_inputs=mm)
        engine.add_request("t", text_ids, SamplingParams(temperature=0, max_tokens=6))
        outs = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                outs[o.request_id] = list(o.outputs[0].token_ids)
        assert outs["t"] == alone
        _check_greedy(outs["v"], chat)
    finally:
        vision.close()
        engine.close()


def test_encoder_on_cuda_matches_the_record():
    engine = LLMEngine(str(TEXT), EngineArgs(device="cuda"))
    vision = open_pipeline(engine)
    try:
        for name, ref in record()["visuals"].items():
            out = vision.encode(prepared(vision, name)).float().cpu()
            want = torch.from_numpy(floats(ref["image_features"], ref["feature_shape"]).copy())
            assert (out - want).abs().max().item() < ENCODER_TOL
    finally:
        vision.close()
        engine.close()
