"""Decode launched one step ahead (`engine.runtime.decode_ahead`): the engine's tokens, greedy
or drawn on the device, are exactly those of the same engine stepping one at a time, whatever
joins, finishes or samples on the host around them.

On the CPU the decode graph's fixed-shape forward stands in for the replay (same inputs, same
interface); tests/engine/test_gpu_graphs.py runs the real graphs on a GPU.
"""

import dataclasses

import pytest
import torch

from localllm.engine import LLM, SamplingParams
from localllm.engine.runtime.cuda_graphs import COLS, DecodeGraphs
from localllm.engine.runtime.decode_ahead import DecodeAhead, stage
from localllm.engine.sampling.sampler import Sampler
from tests.perf.make_synthetic import SHAPES, write_synthetic


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("ahead") / "tiny.gguf"
    write_synthetic(path, dataclasses.replace(SHAPES["tiny"], vocab=512), "Q8_0", None, seed=3)
    return path


class _EagerGraphs:
    """`DecodeGraphs.run`'s interface over its forward run eagerly (the CPU has no graphs)."""

    def __init__(self, graphs: DecodeGraphs):
        self.graphs, self.batch_sizes = graphs, graphs.batch_sizes
        self.fed = 0  # launches whose token ids came from the device

    def run(self, inputs: torch.Tensor, ids: torch.Tensor | None = None, then=None):
        n, w = inputs.shape[0], inputs.shape[1] - COLS
        width = self.graphs.key(n, w)[1]
        x = torch.zeros(n, COLS + width, dtype=torch.long)
        x[:, : COLS + w] = inputs
        if ids is not None:
            x[:, 0] = ids
            self.fed += 1
        logits = self.graphs.forward(x)
        return logits if then is None else then(logits)


def _engine(path, ahead: bool, lookahead: bool = True) -> LLM:
    llm = LLM(str(path), max_model_len=256, device="cpu", block_size=16)
    if ahead and lookahead:  # as on a GPU: a decode token's next slot allocated with it
        sched = llm.engine.scheduler
        sched.config = dataclasses.replace(sched.config, lookahead_slots=1)
    runner = llm.engine.runner
    runner.graphs = _EagerGraphs(DecodeGraphs(runner.model, runner.kv))
    runner.ahead = DecodeAhead(runner.graphs.run) if ahead else None
    runner.sampler = Sampler(device_draws=True)  # as on a GPU: plain sampled rows drawn there
    return llm


def _tokens(llm: LLM, work) -> list[list[int]]:
    """Runs `work` (prompt, params, the step it joins at) and returns each one's tokens."""
    eng, ids, done, step = llm.engine, {}, {}, 0
    while len(done) < len(work):
        for i, (prompt, params, at) in enumerate(work):
            if at == step:
                ids[eng.add_request(None, prompt, params)] = i
        for out in eng.step():
            if out.finished:
                done[ids[out.request_id]] = out.outputs[0].token_ids
        step += 1
    return [done[i] for i in range(len(work))]


def test_ahead_tokens_equal_one_step_at_a_time(tiny):
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = _tokens(_engine(tiny, False), [([5, 17, 33], greedy, 0)])[0]
    stop = plain[12]  # a token the greedy run makes: a request stopped by it ends early
    work = [
        ([5, 17, 33], greedy, 0),  # crosses blocks 16, 32
        (list(range(3, 23)), dataclasses.replace(greedy, max_tokens=7), 0),
        ([8, 9], dataclasses.replace(greedy, stop_token_ids=[stop]), 3),  # joins: drops a step
        ([5, 17, 33], dataclasses.replace(greedy, stop_token_ids=[stop]), 9),
        # a sampled request with a penalty: steps with it run one at a time
        (
            [40, 41],
            SamplingParams(temperature=0.8, seed=7, max_tokens=12, presence_penalty=0.5),
            20,
        ),
        ([77], dataclasses.replace(greedy, max_tokens=30), 30),
    ]
    want = _tokens(_engine(tiny, False), work)
    llm = _engine(tiny, True)
    got = _tokens(llm, work)
    assert got == want
    assert got[0] == plain and len(got[3]) == plain.index(stop) + 1
    # without the lookahead slot no step is launched past a block's end: fewer steps ahead
    bare = _engine(tiny, True, lookahead=False)
    assert _tokens(bare, work) == want
    assert bare.engine.runner.ahead.used < llm.engine.runner.ahead.used
    ahead = llm.engine.runner.ahead
    # most steps were launched ahead and used; joins, ends and the penalized request dropped some
    assert ahead.used >= 30 and ahead.dropped >= 3 and ahead.launched == ahead.used + ahead.dropped
    assert llm.engine.runner.graphs.fed == ahead.launched


def test_sampled_rows_ahead_draw_as_one_step_at_a_time(tiny):
    """Seeded draws are the same ahead: a dropped step puts its generators back."""
    sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=30, ignore_eos=True)
    work = [
        ([5, 17, 33], sampled, 0),
        ([8, 9], dataclasses.replace(sampled, top_k=20, min_p=0.05, seed=4), 2),  # drops one
        ([9], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), 6),  # drops one
        ([3, 4], dataclasses.replace(sampled, temperature=0.3, seed=None), 12),
    ]
    want = _tokens(_engine(tiny, False), work[:3])
    llm = _engine(tiny, True)
    assert _tokens(llm, work[:3]) == want
    ahead = llm.engine.runner.ahead
    assert ahead.used >= 20 and ahead.dropped >= 2
    got = _tokens(llm, work)  # an unseeded request beside them: theirs unchanged
    assert got[:3] == want and len(got[3]) == 30


def test_close_drops_a_step_still_ahead(tiny):
    llm = _engine(tiny, True)
    stop = _tokens(_engine(tiny, False), [([5, 17, 33], SamplingParams(temperature=0), 0)])[0][4]
    p = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop])
    _tokens(llm, [([5, 17, 33], p, 0)])  # ended by its stop token: the step after it was launched
    ahead = llm.engine.runner.ahead
    assert ahead.pending is not None
    llm.close()
    assert ahead.pending is None and ahead.dropped == 1


def test_ahead_stays_off_for_host_sampled_and_logprobs(tiny):
    llm = _engine(tiny, True)
    ps = [
        SamplingParams(temperature=0.7, seed=1, max_tokens=20, ignore_eos=True, typical_p=0.9),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3),
    ]
    for p in ps:
        want = _tokens(_engine(tiny, False), [([3, 4, 5], p, 0)])
        assert _tokens(llm, [([3, 4, 5], p, 0)]) == want
    assert llm.engine.runner.ahead.launched == 0


def _none():
    return None


def test_a_pending_step_is_used_only_when_asked_for_exactly():
    calls = []

    def launch(inputs, ids, then):
        calls.append(None if ids is None else ids.tolist())
        logits = torch.full((inputs.shape[0], 8), -1.0)
        logits[torch.arange(inputs.shape[0]), inputs[:, 1] % 8] = 1.0  # argmax = position % 8
        return then(logits)

    ahead = DecodeAhead(launch)
    key = (("a", 4), ("b", 9))
    cur = ahead.run(key, lambda: torch.tensor([[0, 4], [0, 9]]), [1, 2], _none)
    ahead.ahead(cur, (("a", 5), ("b", 10)), torch.tensor([[0, 5], [0, 10]]), _none)
    assert ahead.read(cur) == ([1.0, 1.0], [4, 1])
    assert calls == [None, [4, 1]]  # the step after was fed this one's argmax on the device
    # asked for with other tokens than it was fed: dropped and launched again
    assert ahead.take((("a", 5), ("b", 10)), [4, 2]) is None and ahead.dropped == 1
    ahead.ahead(cur, (("a", 5), ("b", 10)), torch.tensor([[0, 5], [0, 10]]), _none)
    ahead.read(cur)
    assert ahead.take((("a", 5),), [4]) is None and ahead.dropped == 2  # another batch
    ahead.ahead(cur, (("a", 5), ("b", 10)), torch.tensor([[0, 5], [0, 10]]), _none)
    ahead.read(cur)
    got = ahead.take((("a", 5), ("b", 10)), [4, 1])
    assert got is not None and ahead.used == 1 and ahead.pending is None
    assert got.read() == ([1.0, 1.0], [5, 2])


def test_stage_keeps_ids_exact_past_float32():
    logits = torch.full((1, 1 << 25), -3.0)
    logits[0, (1 << 24) + 1] = 2.0  # an id float32 cannot hold
    s = stage((("a", 0),), logits)
    assert s.read() == ([2.0], [(1 << 24) + 1]) and s.ids.tolist() == [(1 << 24) + 1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_ahead_on_real_graphs_equals_one_step_at_a_time(tiny):
    import gc

    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    work = [
        ([5, 17, 33], greedy, 0),
        (list(range(3, 23)), dataclasses.replace(greedy, max_tokens=7), 0),
        ([8, 9], greedy, 3),
        ([40, 41], SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True), 20),
        ([6], SamplingParams(temperature=0.8, top_p=0.9, seed=2, max_tokens=20, min_p=0.05), 24),
        ([7, 7], dataclasses.replace(greedy, repetition_penalty=1.2), 26),  # on the host
    ]
    got, used = {}, 0
    for ahead in (False, True):
        llm = LLM(str(tiny), max_model_len=256, device="cuda")
        runner = llm.engine.runner
        assert runner.ahead is not None  # on by default on CUDA
        if not ahead:
            runner.ahead = None
        got[ahead] = _tokens(llm, work)
        if ahead:
            used = runner.ahead.used
            assert runner.graphs.failed is None
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()
    assert got[True] == got[False]
    assert used >= 12  # 16 on the CPU's stand-in for the same work


def test_warm_up_stages_argmax_drawn_and_mixed_rows_with_every_control_on(monkeypatch):
    """What the runner launches once before any replay (a first launch may load a module, which
    may wait for the device: behind a split step, for the host): every path `stage` takes."""
    from localllm.engine.runtime import decode_ahead

    seen = []

    def spy(key, logits, draw=None):
        seen.append(None if draw is None else (draw.rows, draw.params))
        return stage(key, logits, draw)

    monkeypatch.setattr(decode_ahead, "stage", spy)
    decode_ahead.warm_up(300, torch.device("cpu"))
    assert seen[0] is None and [s[0] for s in seen[1:]] == [[0, 1], [1]]
    for _, params in seen[1:]:
        p = params[0]
        assert p.temperature > 0 and p.top_k and p.top_p < 1 and p.min_p > 0
