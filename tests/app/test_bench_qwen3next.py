"""`localllm bench` on the qwen3next fixture (a hybrid: DeltaNet state slots beside the KV cache):
a pp and a tg row with a positive rate, resident and with its experts streamed from disk (which
reports its expert cache)."""

import json

from localllm.app.cli import main
from tests.engine.family_goldens import path


def _bench(capsys, *flags: str) -> list[dict]:
    argv = ["bench", "-m", str(path("qwen3next")), "-p", "16", "-n", "4", "-r", "1", "-o", "json"]
    assert main([*argv, *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_bench_runs(capsys):
    rows = _bench(capsys)
    assert [(r["n_prompt"], r["n_gen"]) for r in rows] == [(16, 0), (0, 4)]
    assert all(r["avg_ts"] > 0 for r in rows)


def test_bench_streams_experts_from_disk(capsys):
    rows = _bench(capsys, "--experts", "disk", "--expert-slots", "2")
    assert all(r["experts"]["lookups"] > 0 and r["experts"]["misses"] > 0 for r in rows)
