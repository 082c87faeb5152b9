"""`localllm bench` on each converted-family fixture (smollm3, olmo2, gemma2, glm4moe): a pp and a
tg row with a positive rate, for the dense families and the MoE one, whose disk-streamed run also
reports its expert cache."""

import json

import pytest

from localllm.app.cli import main
from tests.engine.family_goldens import NAMES, path


def _bench(capsys, name: str, *flags: str) -> list[dict]:
    argv = ["bench", "-m", str(path(name)), "-p", "16", "-n", "4", "-r", "1", "-o", "json"]
    assert main([*argv, *flags]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", NAMES)
def test_bench_runs(name, capsys):
    rows = _bench(capsys, name)
    assert [(r["n_prompt"], r["n_gen"]) for r in rows] == [(16, 0), (0, 4)]
    assert all(r["avg_ts"] > 0 for r in rows)


def test_bench_streams_glm_experts_from_disk(capsys):
    rows = _bench(capsys, "glm4moe", "--experts", "disk", "--expert-slots", "2")
    assert all(r["experts"]["lookups"] > 0 and r["experts"]["misses"] > 0 for r in rows)
