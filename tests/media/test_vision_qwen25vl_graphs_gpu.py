"""Qwen2.5-VL on CUDA (marked `gpu`): which steps of an image prompt replay CUDA graphs.

A step whose tokens carry an image's embeddings or 3-axis M-RoPE positions runs eagerly (the
captured prompt graphs take plain ids and one rope position per token); every decode step after
it must replay a decode graph, its rope position shifted by the request's constant offset. The
test counts the runner's graph and eager steps of greedy requests whose tokens are checked
against transformers' record (tests/data/vision/qwen25vl.json), with and without decode-ahead.
"""

import contextlib

import pytest
import torch

from localllm.engine import EngineArgs, LLMEngine
from tests.media.test_vision_qwen25vl import TEXT, _check_greedy, _prompt, open_pipeline, record
from tests.media.vision_fixture import run_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def cuda_engine():
    # no prefix cache: a repeated prompt's hit could leave a one-token prompt step (graphable)
    engine = LLMEngine(str(TEXT), EngineArgs(device="cuda", enable_prefix_caching=False))
    vision = open_pipeline(engine)
    yield engine, vision
    vision.close()
    engine.close()


@contextlib.contextmanager
def counted_steps(runner):
    """Counts of the steps the runner's graph path answered and those it left to eager."""
    seen = {"graph": 0, "eager": 0}
    inner = runner._execute_graph

    def counted(sched):
        out = inner(sched)
        seen["graph" if out is not None else "eager"] += 1
        return out

    runner._execute_graph = counted
    try:
        yield seen
    finally:
        del runner._execute_graph  # the class's method again


@pytest.mark.parametrize("ahead", [True, False])
@pytest.mark.parametrize("name", ["one_image", "two_images", "video"])
def test_decode_after_an_image_prompt_replays_graphs(cuda_engine, name, ahead):
    engine, vision = cuda_engine
    runner = engine.runner
    launcher = runner.ahead
    assert launcher is not None
    if not ahead:  # each decode step replayed and read before the next is launched
        runner.ahead = None
    try:
        chat, ids, mm = _prompt(vision, engine, name)
        with counted_steps(runner) as seen:
            ours, _ = run_greedy(engine, ids, mm, len(chat["greedy_ids"]), rid=f"{name}-{ahead}")
        _check_greedy(ours, chat)
        # the whole prompt in one eager step (it yields the first token), then the decodes
        assert seen == {"graph": len(ours) - 1, "eager": 1}, seen
    finally:
        runner.ahead = launcher


def test_an_image_prompt_in_chunks_runs_its_chunks_eagerly_then_decodes_in_graphs():
    engine = LLMEngine(str(TEXT), EngineArgs(device="cuda", max_num_batched_tokens=8))
    vision = open_pipeline(engine)
    try:
        chat, ids, mm = _prompt(vision, engine, "two_images")
        with counted_steps(engine.runner) as seen:
            ours, _ = run_greedy(engine, ids, mm, len(chat["greedy_ids"]), rid="chunked")
        _check_greedy(ours, chat)
        assert len(ids) % 8 > 1  # no one-token last chunk (that one may replay a decode graph)
        assert seen["eager"] == -(-len(ids) // 8), seen
        assert seen["graph"] == len(ours) - 1, seen
    finally:
        vision.close()
        engine.close()


def test_the_record_has_decode_steps_to_count():
    assert all(len(c["greedy_ids"]) >= 4 for c in record()["chats"].values())
