"""The settings file: every section parsed, env overrides, clear errors, a save/load round trip."""

from pathlib import Path

import pytest

from localllm.app.model_path import resolve_model
from localllm.app.settings import (
    SamplingDefaults,
    Settings,
    config_path,
    load_settings,
    save_settings,
)


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"XDG_CONFIG_HOME": str(tmp_path), **extra}


def _write(tmp_path: Path, text: str) -> Path:
    cfg = tmp_path / "localllm" / "config.toml"
    cfg.parent.mkdir(exist_ok=True)
    cfg.write_text(text)
    return cfg


def test_absent_file_gives_defaults(tmp_path):
    assert load_settings(env=_env(tmp_path)) == Settings()
    assert config_path(_env(tmp_path)) == tmp_path / "localllm" / "config.toml"
    assert config_path({"LOCALLLM_CONFIG": "~/x.toml"}) == Path("~/x.toml").expanduser()


def test_every_section_and_env_overrides(tmp_path):
    _write(
        tmp_path,
        '[models]\ndirs = ["/data/gguf"]\ndefault = "org/repo:Q8_0"\n'
        '[sampling]\ntemperature = 1\ntop_k = 5\nsystem_prompt = "Be brief."\n'
        '[ui]\ntheme = "light"\n',
    )
    s = load_settings(env=_env(tmp_path))
    assert s.model_dirs == (Path("/data/gguf"),)
    assert s.default_model == "org/repo:Q8_0"
    assert s.sampling == SamplingDefaults(temperature=1.0, top_k=5, system_prompt="Be brief.")
    assert isinstance(s.sampling.temperature, float)
    assert s.theme == "light"
    env = _env(tmp_path, LOCALLLM_MODEL_DIRS="/a:/b", LOCALLLM_MODEL="/m.gguf")
    s = load_settings(env=env)
    assert [str(p) for p in s.model_dirs] == ["/a", "/b", "/data/gguf"]
    assert s.default_model == "/m.gguf"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[models]\ndirs = "/data"\n', "dirs must be a list"),
        ("[models]\ndir = []\n", r"unknown key\(s\) in \[models\]: dir"),
        ("[models\n", "not valid TOML"),
        ("[model]\n", r"unknown section\(s\): model"),
        ("models = 3\n", r"\[models\] must be a table"),
        ("[sampling]\ntemperature = 'hot'\n", "sampling.temperature must be a number"),
        ("[sampling]\ntop_k = 2.5\n", "sampling.top_k must be an integer"),
        ("[sampling]\ntop_p = 1.5\n", r"sampling.top_p = 1.5 is out of range \[0.0, 1.0\]"),
        ("[sampling]\nmax_tokens = 0\n", "sampling.max_tokens = 0 is out of range"),
        ("[sampling]\nsystem_prompt = 3\n", "sampling.system_prompt must be a string"),
        ("[sampling]\nseed = 3\n", r"unknown key\(s\) in \[sampling\]: seed"),
        ("[ui]\ntheme = 3\n", "theme must be a theme name"),
        ('[models]\ndefault = ""\n', "default must be a model name"),
    ],
)
def test_invalid_settings_name_the_file_and_key(tmp_path, text, message):
    cfg = _write(tmp_path, text)
    with pytest.raises(ValueError, match=message) as e:
        load_settings(env=_env(tmp_path))
    assert str(cfg) in str(e.value)


def test_save_then_load_round_trips(tmp_path):
    s = Settings(
        model_dirs=(Path("/x y"), Path("/z")),
        default_model='odd "name"',
        sampling=SamplingDefaults(temperature=0.2, max_tokens=64, system_prompt='a "b"\nc'),
        theme="textual-light",
    )
    path = tmp_path / "sub" / "config.toml"
    save_settings(s, path)
    assert load_settings(path=path, env={}) == s
    assert not path.with_suffix(".toml.tmp").exists()


def test_default_model_from_settings_is_what_run_uses(tmp_path, monkeypatch):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.delenv("LOCALLLM_MODEL", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    _write(tmp_path, f'[models]\ndefault = "{model}"\n')
    assert resolve_model(None) == model
    _write(tmp_path, "[sampling]\ntop_p = 9\n")
    with pytest.raises(ValueError, match="top_p"):
        resolve_model(None)
