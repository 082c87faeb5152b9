"""`localllm bench` finds its model as `run` does: the embedded default without `-m`, a library
name (the one the TUI and `ls` show), a path; through the real CLI in a fresh home."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

QUICK = ("-p", "8", "-n", "2", "-r", "1", "-o", "json")


def _bench(tmp_path, *args):
    env = dict(os.environ, PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1", LOCALLLM_MODEL_DIRS="")
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_CACHE=str(tmp_path / "hf" / "hub"))
    env.update(XDG_CONFIG_HOME=str(tmp_path / "config"), XDG_DATA_HOME=str(tmp_path / "data"))
    env.pop("LOCALLLM_MODEL", None)
    env.pop("LOCALLLM_CONFIG", None)
    cmd = [sys.executable, "-m", "localllm.app", "bench", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def _models(proc) -> list[str]:
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [(r["n_prompt"], r["n_gen"]) for r in rows] == [(8, 0), (0, 2)]
    return [r["model_filename"] for r in rows]


def test_no_model_given_benches_the_embedded_default(smollm2_path, tmp_path):
    assert _models(_bench(tmp_path, *QUICK)) == [smollm2_path.name] * 2


def test_the_name_the_tui_shows(smollm2_path, tmp_path):
    proc = _bench(tmp_path, "-m", smollm2_path.stem, *QUICK)
    assert _models(proc) == [smollm2_path.name] * 2


def test_an_unknown_name_is_one_error_line(tmp_path):
    proc = _bench(tmp_path, "-m", "nothing-like-it", *QUICK)
    assert proc.returncode == 1 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("localllm: error: model not found: ")
