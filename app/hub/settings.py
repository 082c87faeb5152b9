"""The user's settings file (TOML under the XDG config dir), as far as the model library needs it.

    [models]
    dirs = ["~/models", "/data/gguf"]   # extra folders scanned for GGUF files

plus `LOCALLLM_MODEL_DIRS` (os.pathsep-separated) from the environment.
"""

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Settings:
    """Validated settings; only what the library uses so far."""

    model_dirs: tuple[Path, ...] = ()


def config_path(env: dict[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    base = env.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "localllm" / "config.toml"


def _dirs(value: object, where: str) -> tuple[Path, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where}: [models] dirs must be a list of folder paths (strings)")
    return tuple(Path(v).expanduser() for v in value)


def load_settings(path: Path | None = None, env: dict[str, str] | None = None) -> Settings:
    """Read the settings file (absent is fine) and LOCALLLM_MODEL_DIRS; ValueError when invalid."""
    env = os.environ if env is None else env
    path = path or config_path(env)
    data: dict = {}
    if path.is_file():
        try:
            data = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not valid TOML ({e})") from None
    models = data.get("models", {})
    if not isinstance(models, dict):
        raise ValueError(f"{path}: [models] must be a table")
    unknown = sorted(set(models) - {"dirs"})
    if unknown:
        raise ValueError(f"{path}: unknown key(s) in [models]: {', '.join(unknown)}")
    dirs = _dirs(models.get("dirs", []), str(path))
    extra = tuple(
        Path(p).expanduser() for p in env.get("LOCALLLM_MODEL_DIRS", "").split(os.pathsep) if p
    )
    return Settings(model_dirs=extra + dirs)
