"""`localllm bench` on the hybrid fixtures (lfm2, granitehybrid MoE and dense): a pp and a tg row
each, the recurrent state in one slot; Granite's experts also streamed from disk, where the run
reports its expert cache."""

import json

import pytest

from localllm.app.cli import main
from tests.engine.family_goldens import path


def _bench(capsys, name: str, *flags: str) -> list[dict]:
    argv = ["bench", "-m", str(path(name)), "-p", "16", "-n", "4", "-r", "1", "-o", "json"]
    assert main([*argv, *flags]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", ["lfm2", "lfm2moe", "granitehybrid", "granitehybrid_dense"])
def test_bench_runs(name, capsys):
    rows = _bench(capsys, name)
    assert [(r["n_prompt"], r["n_gen"]) for r in rows] == [(16, 0), (0, 4)]
    assert all(r["avg_ts"] > 0 for r in rows)


def test_bench_streams_granite_experts_from_disk(capsys):
    rows = _bench(capsys, "granitehybrid", "--experts", "disk", "--expert-slots", "2")
    assert all(r["experts"]["lookups"] > 0 and r["experts"]["misses"] > 0 for r in rows)
