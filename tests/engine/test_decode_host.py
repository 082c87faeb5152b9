"""The decode graphs' host side at many sequences (issue 38): `pack_decode` builds the rows a
replay reads exactly as the plain row-by-row construction does, and a decode step launched ahead
and then used costs no rows of its own (only launches build rows).

On the CPU the decode graph's fixed-shape forward stands in for the replay, as in
tests/engine/test_decode_ahead.py (which checks the tokens themselves).
"""

import dataclasses
import random

import pytest
import torch

import localllm.engine.runtime.runner as runner_module
from localllm.engine import LLM, SamplingParams
from localllm.engine.runtime.cuda_graphs import COLS, DecodeGraphs, pack_decode
from localllm.engine.runtime.decode_ahead import DecodeAhead
from tests.perf.make_synthetic import SHAPES, write_synthetic


def _rows(ids, positions, slots, tables, shifts=None, states=None):
    """The rows as the docstring defines them, one Python list per sequence."""
    width = max(len(t) for t in tables)
    shifts = shifts or [0] * len(ids)
    states = states or [0] * len(ids)
    return torch.tensor(
        [[i, p + d, s, p + 1, st, *t, *[0] * (width - len(t))]
         for i, p, s, t, d, st in zip(ids, positions, slots, tables, shifts, states, strict=True)],
        dtype=torch.long,
    )  # fmt: skip


@pytest.mark.parametrize("n", [1, 3, 64])
@pytest.mark.parametrize("shifted", [False, True])
def test_pack_decode_rows(n, shifted):
    rng = random.Random(n)
    tables = [[rng.randrange(10_000) for _ in range(rng.randint(1, 150))] for _ in range(n)]
    positions = [rng.randrange(16 * len(t)) for t in tables]
    ids = [rng.randrange(150_000) for _ in range(n)]
    slots = [rng.randrange(1 << 40) for _ in range(n)]  # int64, past int32
    shifts = [rng.randint(-5, 500) for _ in range(n)] if shifted else None
    states = [rng.randrange(64) for _ in range(n)] if shifted else None  # (a hybrid's slots)
    got = pack_decode(ids, positions, slots, tables, shifts, states)
    want = _rows(ids, positions, slots, tables, shifts, states)
    assert got.dtype == torch.long and torch.equal(got, want)


class _Replay:
    """`DecodeGraphs.run` over its forward run eagerly; counts launches."""

    def __init__(self, graphs: DecodeGraphs):
        self.graphs, self.batch_sizes = graphs, graphs.batch_sizes
        self.launches = 0

    def run(self, inputs, ids=None, then=None):
        self.launches += 1
        n, w = inputs.shape[0], inputs.shape[1] - COLS
        x = torch.zeros(n, COLS + self.graphs.key(n, w)[1], dtype=torch.long)
        x[:, : COLS + w] = inputs
        if ids is not None:
            x[:, 0] = ids
        logits = self.graphs.forward(x)
        return logits if then is None else then(logits)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("host") / "tiny.gguf"
    write_synthetic(path, dataclasses.replace(SHAPES["tiny"], vocab=512), "Q8_0", None, seed=4)
    return path


def test_a_step_taken_from_ahead_builds_no_rows(tiny, monkeypatch):
    llm = LLM(str(tiny), max_model_len=256, device="cpu", block_size=16)
    sched = llm.engine.scheduler
    sched.config = dataclasses.replace(sched.config, lookahead_slots=1)  # as on a GPU
    runner = llm.engine.runner
    runner.graphs = replay = _Replay(DecodeGraphs(runner.model, runner.kv))
    runner.ahead = DecodeAhead(replay.run)
    built = []

    def counted(*a, **kw):
        built.append(None)
        return pack_decode(*a, **kw)

    monkeypatch.setattr(runner_module, "pack_decode", counted)
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    outs = llm.generate([[5, 17, 33], [8, 9], list(range(3, 23))], p)
    assert [len(o.outputs[0].token_ids) for o in outs] == [30, 30, 30]
    assert runner.ahead.used >= 20  # most decode steps were launched ahead
    # every set of rows built was launched: none for the steps taken from the one pending
    assert len(built) == replay.launches
