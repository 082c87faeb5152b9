"""A model pulled from the Hub knows its vision projector; a local file never borrows one."""

import os
import subprocess
import sys

import pytest

from localllm.app.hub.download import pull
from localllm.app.hub.pairing import paired_mmproj
from tests.app.hub.conftest import REPO
from tests.media.vision_fixture import DATA, MMPROJ, TEXT


@pytest.fixture
def repo_files() -> dict[str, bytes]:
    """A SmolVLM-style repo: one text model and its projector (the vision fixture's files; the
    name `tiny-Q8_0.gguf` is the one the shared fake Hub also serves as another repo)."""
    return {"tiny-Q8_0.gguf": TEXT.read_bytes(), "mmproj-tiny-F16.gguf": MMPROJ.read_bytes()}


def test_a_pulled_model_is_paired_by_its_hub_name(hub, config):
    got = pull(REPO, config=config)
    assert got.mmproj is not None
    assert paired_mmproj(f"{REPO}:Q8_0") == got.mmproj
    assert paired_mmproj(REPO) == got.mmproj  # the repo alone: its only model
    assert paired_mmproj(str(got.path)) is None  # the same file named by path: no pairing


def test_a_local_model_is_not_paired_with_its_neighbour(hub, monkeypatch):
    monkeypatch.setenv("LOCALLLM_MODEL_DIRS", str(DATA))  # the folder holds the mmproj too
    assert paired_mmproj(str(TEXT)) is None
    assert paired_mmproj(TEXT.stem) is None
    assert paired_mmproj(None) is None


def test_run_with_a_pulled_model_needs_no_mmproj_flag(hub, config):
    pull(REPO, config=config)
    image = str(DATA / "tall.png")
    cmd = [sys.executable, "-m", "localllm.app", "run", "-m", f"{REPO}:Q8_0", "--image", image,
           "--temperature", "0", "-n", "4", "What is in this image?"]  # fmt: skip
    env = dict(os.environ, PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, capture_output=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout  # the answer (its tokens are checked in tests/app/test_cli_vision.py)


def test_the_tui_pairs_a_pulled_model_it_loads_by_its_cache_path(hub, config):
    """The TUI's library and downloads load a pulled model by its path in the cache: the
    projector pulled with it comes along; a file outside the cache still gets none."""
    from localllm.app.hub.pairing import pulled_mmproj
    from localllm.app.tui.loaders import _projector

    got = pull(REPO, config=config)
    assert _projector(str(got.path), None) == got.mmproj
    assert pulled_mmproj(str(got.path)) == got.mmproj
    assert _projector(str(TEXT), None) is None
    assert pulled_mmproj(str(DATA / "nowhere.gguf")) is None


def test_ls_and_the_library_say_which_models_see(hub, config, capsys, monkeypatch):
    from localllm.app.cli import main
    from localllm.app.hub.library import scan_library

    pull(REPO, config=config)
    pull("tiny-org/only-q8", config=config)
    monkeypatch.setenv("LOCALLLM_MODEL_DIRS", str(DATA))  # a folder with an mmproj beside
    assert main(["ls"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows[f"{REPO}:Q8_0"][4] == "llama(vision)"
    assert rows["tiny-org/only-q8:Q8_0"][4] == "llama"
    assert rows[TEXT.stem][4] == "llama"  # a folder's neighbour is not its projector
    seen = {m.name: m.vision for m in scan_library(config.cache_dir)}
    assert seen == {f"{REPO}:Q8_0": True, "tiny-org/only-q8:Q8_0": False}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_the_tui_loads_a_pulled_model_with_its_projector_and_lists_it_as_seeing(
    hub, config, tmp_path
):
    """Driven with Pilot: the TUI loads what it pulled by its cache path (as after a download)
    with the real engine loader, which brings the projector; the library marks the model."""
    from textual.widgets import DataTable

    from localllm.app.tui.loaders import engine_loader
    from localllm.app.tui.screens.models import ModelScreen
    from tests.app.tui.fakes import make_app, wait_for

    got = pull(REPO, config=config)
    app = make_app(tmp_path, hub_config=lambda: config, model=str(got.path))
    app.loader = engine_loader(max_num_seqs=1)
    async with app.run_test(size=(120, 30)) as pilot:
        await wait_for(pilot, lambda: app.backend is not None, limit=3000)
        assert app.backend.vision is not None  # it sees
        assert app.backend.vision.path == str(got.mmproj)
        await pilot.press("ctrl+l")
        await wait_for(pilot, lambda: isinstance(app.screen, ModelScreen))
        table = app.screen.query_one("#library-table", DataTable)
        await wait_for(pilot, lambda: table.row_count > 0)
        rows = {
            str(r[0]): [str(c) for c in r] for r in map(table.get_row_at, range(table.row_count))
        }
        assert rows[f"{REPO}:Q8_0"][3] == "llama(vision)"
        await app.unload_model()
