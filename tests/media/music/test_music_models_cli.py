"""A MusicGen folder in the library: `localllm ls` lists it as a music model, and `run`/`serve -m`
refuse it in one line that names `localllm music` and `serve --music` (they load LLMs), while
`localllm music -m` still takes it. Real CLI processes on a copy of the recorded fixture."""

import os
import shutil
import subprocess
import sys

import pytest

from localllm.app.model_path import ModelNotFoundError, resolve_model
from localllm.app.music import resolve_music_model
from tests.media.music.music_fixture import DATA


@pytest.fixture
def library(tmp_path):
    shutil.copytree(DATA / "musicgen", tmp_path / "lib" / "musicgen-tiny")
    return tmp_path / "lib"


def _cli(*args, env_extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_extra}
    return subprocess.run([sys.executable, "-m", "localllm.app", *args], capture_output=True,
                          text=True, timeout=120, env=env)  # fmt: skip


def test_resolve_model_refuses_a_musicgen_folder_and_music_takes_it(library):
    folder = library / "musicgen-tiny"
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model(str(folder))
    msg = str(e.value)
    assert "\n" not in msg and "MusicGen music model" in msg
    assert f'localllm music -m {folder} "PROMPT"' in msg and f"serve --music {folder}" in msg
    assert resolve_music_model(str(folder)) == folder


def test_ls_lists_musicgen_as_music_and_run_serve_point_to_music(library, tmp_path):
    env = {"LOCALLLM_MODEL_DIRS": str(library), "HF_HUB_CACHE": str(tmp_path / "hub"),
           "LOCALLLM_CONFIG": str(tmp_path / "none.toml")}  # fmt: skip
    ls = _cli("ls", env_extra=env)
    assert ls.returncode == 0, ls.stderr
    row = next(line.split() for line in ls.stdout.splitlines() if line.startswith("musicgen-tiny"))
    assert row[1] == "safetensors" and row[4:6] == ["musicgen(music)", "-"]
    for cmd in (["run", "-m", "musicgen-tiny", "hello"], ["serve", "-m", "musicgen-tiny"]):
        done = _cli(*cmd, env_extra=env)
        assert done.returncode != 0
        err = done.stderr.strip()
        assert err.count("\n") == 0, err
        assert err.startswith("localllm: error: musicgen-tiny is a MusicGen music model")
        assert 'localllm music -m musicgen-tiny "PROMPT"' in err
        assert "localllm serve --music musicgen-tiny" in err
