"""The TUI's view of the settings file: sampling defaults, default model, theme, model folders."""

import pytest

from localllm.app.tui.config import load_config, theme_name


def test_settings_file_feeds_the_tui(tmp_path, monkeypatch):
    cfg = tmp_path / "config.toml"
    cfg.write_text(
        '[models]\ndirs = ["/data/gguf"]\ndefault = "my.gguf"\n'
        '[sampling]\ntemperature = 0.3\nmax_tokens = 99\nsystem_prompt = "Be kind."\n'
        '[ui]\ntheme = "light"\n'
    )
    monkeypatch.setenv("LOCALLLM_CONFIG", str(cfg))
    monkeypatch.delenv("LOCALLLM_MODEL_DIRS", raising=False)
    monkeypatch.delenv("LOCALLLM_MODEL", raising=False)
    c = load_config()
    assert [str(d) for d in c.model_dirs] == ["/data/gguf"]
    assert c.default_model == "my.gguf" and c.theme == "textual-light"
    s = c.sampling
    assert (s.temperature, s.max_tokens, s.system_prompt, s.top_p) == (0.3, 99, "Be kind.", 0.95)


def test_invalid_settings_fail_clearly(tmp_path, monkeypatch):
    cfg = tmp_path / "config.toml"
    cfg.write_text("[sampling]\ntemprature = 1\n")
    monkeypatch.setenv("LOCALLLM_CONFIG", str(cfg))
    with pytest.raises(ValueError, match="temprature"):
        load_config()


def test_theme_names():
    assert theme_name("dark") == "textual-dark"
    assert theme_name(None) == "textual-dark"
    assert theme_name("nord") == "nord"
