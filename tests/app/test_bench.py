"""`localllm bench` on a tiny model on the CPU: the output formats and their fields (not speed)."""

import csv
import io
import json
import statistics

import gguf
import pytest

from localllm.app.cli import main
from tests.engine.tiny_models import SPECS, write_tiny_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("bench") / "tiny.gguf", SPECS["llama"], True)


def test_json_has_llama_bench_fields(tiny, capsys):
    rc = main(
        ["bench", "-m", str(tiny), "-p", "8,16", "-n", "4", "-d", "0,5", "-r", "2", "-o", "json"]
    )
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)
    reader = gguf.GGUFReader(tiny)
    n_params = sum(int(t.n_elements) for t in reader.tensors)
    n_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    tests = [(r["n_prompt"], r["n_gen"], r["n_depth"]) for r in rows]
    assert tests == [(8, 0, 0), (16, 0, 0), (0, 4, 0), (8, 0, 5), (16, 0, 5), (0, 4, 5)]
    for r in rows:
        assert r["model_filename"] == "tiny.gguf" and r["backend"] == "CPU"
        assert r["model_n_params"] == n_params and r["model_size"] == n_bytes
        assert len(r["samples_ts"]) == 2 and all(s > 0 for s in r["samples_ts"])
        assert r["avg_ts"] == pytest.approx(statistics.fmean(r["samples_ts"]))
        assert r["stddev_ts"] == pytest.approx(statistics.stdev(r["samples_ts"]))


def test_csv_and_markdown(tiny, capsys):
    assert main(["bench", "-m", str(tiny), "-p", "8", "-n", "2", "-r", "1", "-o", "csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [(r["n_prompt"], r["n_gen"]) for r in rows] == [("8", "0"), ("0", "2")]
    assert all(float(r["avg_ts"]) > 0 and float(r["stddev_ts"]) == 0.0 for r in rows)
    assert main(["bench", "-m", str(tiny), "-p", "8", "-n", "2", "-r", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| model | size | params | backend | test | t/s |")
    assert len(lines) == 4
    cells = [[c.strip() for c in line.split("|")] for line in lines[2:]]
    assert [c[5] for c in cells] == ["pp8", "tg2"] and all(c[4] == "CPU" for c in cells)
    assert all(float(c[6].split(" ± ")[0]) > 0 for c in cells)


def test_bad_repetitions_is_a_user_error(tiny, capsys):
    assert main(["bench", "-m", str(tiny), "-r", "0"]) == 1
    assert "-r must be >= 1" in capsys.readouterr().err
