"""Qwen2.5-VL on CUDA (marked `gpu`): which steps of an image prompt replay CUDA graphs.

A step whose tokens carry an image's embeddings or 3-axis M-RoPE positions runs eagerly (the
captured prompt graphs take plain ids and one rope position per token); every decode step after
it must replay a decode graph, its rope position shifted by the request's constant offset. The
test counts the runner's graph and eager steps of greedy requests whose tokens are checked
against transformers' record (tests/data/vision/qwen25vl.json), with and without decode-ahead.
"""

import pytest
import torch

from localllm.engine import EngineArgs, LLMEngine
from tests.media.test_vision_qwen25vl import TEXT, _check_greedy, _prompt, open_pipeline, record
from tests.media.vision_fixture import run_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _count_steps(runner) -> dict:
    """Wrap the runner's graph path: counts of steps it answered and steps left to eager."""
    seen = {"graph": 0, "eager": 0}
    inner = runner._execute_graph

    def counted(sched):
        out = inner(sched)
        seen["graph" if out is not None else "eager"] += 1
        return out

    runner._execute_graph = counted
    return seen


@pytest.mark.parametrize("ahead", [True, False])
@pytest.mark.parametrize("name", ["one_image", "two_images", "video"])
def test_decode_after_an_image_prompt_replays_graphs(name, ahead):
    engine = LLMEngine(str(TEXT), EngineArgs(device="cuda"))
    vision = open_pipeline(engine)
    try:
        assert engine.runner.ahead is not None
        if not ahead:  # each decode step replayed and read before the next is launched
            engine.runner.ahead = None
        chat, ids, mm = _prompt(vision, engine, name)
        seen = _count_steps(engine.runner)
        n = len(chat["greedy_ids"])
        ours, _ = run_greedy(engine, ids, mm, n, rid=f"{name}-{ahead}")
        _check_greedy(ours, chat)
        # the whole prompt in one eager step (it yields the first token), then n - 1 decodes
        assert seen == {"graph": len(ours) - 1, "eager": 1}, seen
    finally:
        vision.close()
        engine.close()


def test_an_image_prompt_in_chunks_runs_its_chunks_eagerly_then_decodes_in_graphs():
    engine = LLMEngine(str(TEXT), EngineArgs(device="cuda", max_num_batched_tokens=8))
    vision = open_pipeline(engine)
    try:
        chat, ids, mm = _prompt(vision, engine, "two_images")
        seen = _count_steps(engine.runner)
        n = len(chat["greedy_ids"])
        ours, _ = run_greedy(engine, ids, mm, n, rid="chunked")
        _check_greedy(ours, chat)
        assert len(ids) % 8 > 1  # no one-token last chunk (that one may replay a decode graph)
        assert seen["eager"] == -(-len(ids) // 8), seen
        assert seen["graph"] == len(ours) - 1, seen
    finally:
        vision.close()
        engine.close()


def test_the_record_has_decode_steps_to_count():
    assert all(len(c["greedy_ids"]) >= 4 for c in record()["chats"].values())
