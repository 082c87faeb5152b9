"""What the TUI takes from the user's settings file: model folders, default model, sampling, theme,
and the speech models (Whisper for attached audio, a Piper voice for speaking replies).

`localllm.app.settings` is read lazily; where it (or a field) is missing the TUI falls back to
the library's own settings reader and built-in defaults. Invalid settings raise ValueError.
"""

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localllm.app.model_path import default_model
from localllm.app.tui.backend import GenSettings

THEMES = {"dark": "textual-dark", "light": "textual-light"}


@dataclass(frozen=True)
class TuiConfig:
    model_dirs: tuple[Path, ...] = ()
    default_model: str | None = None
    sampling: GenSettings = field(default_factory=GenSettings)
    theme: str = "textual-dark"
    builtin_dirs: tuple[Path, ...] = ()  # where the embedded default model lives, if installed
    whisper_model: Path | None = None  # None: the packaged Whisper
    voice: Path | None = None  # None: the packaged Piper voice


def theme_name(value: str | None) -> str:
    """A Textual theme name for a settings value (`dark`, `light` or a Textual theme)."""
    if not value:
        return "textual-dark"
    return THEMES.get(value.lower(), value)


def _sampling(sampling: Any) -> GenSettings:
    if sampling is None:
        return GenSettings()
    known = {
        k: getattr(sampling, k)
        for k in ("system_prompt", "temperature", "top_p", "top_k", "min_p", "max_tokens")
        if getattr(sampling, k, None) is not None
    }
    return GenSettings.from_dict(known)


def load_config() -> TuiConfig:
    embedded = default_model()
    try:
        settings = importlib.import_module("localllm.app.settings").load_settings()
    except ImportError:
        settings = importlib.import_module("localllm.app.hub.settings").load_settings()
    return TuiConfig(
        model_dirs=tuple(getattr(settings, "model_dirs", ()) or ()),
        default_model=getattr(settings, "default_model", None),
        sampling=_sampling(getattr(settings, "sampling", None)),
        theme=theme_name(getattr(settings, "theme", None)),
        builtin_dirs=(embedded.parent,) if embedded else (),
        whisper_model=getattr(settings, "whisper_model", None),
        voice=getattr(settings, "voice", None),
    )
