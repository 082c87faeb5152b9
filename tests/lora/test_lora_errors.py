"""Adapters we cannot apply fail at load with one line naming the adapter and the reason."""

import json
import shutil
import subprocess
import sys

import pytest

from localllm.engine.llm import LLM
from localllm.engine.lora import LoraError, LoraSpec
from localllm.engine.sampling.params import SamplingParams
from tests.lora.lora_refs import HF, LORA


def _load(base: str, path) -> str:
    with pytest.raises(LoraError) as e:
        LLM(str(HF / base), lora=(LoraSpec(str(path)),))
    text = str(e.value)
    assert "\n" not in text and str(path) in text
    return text


def _edited(tmp_path, name: str, **changes):
    """A copy of an adapter folder with adapter_config.json keys changed."""
    d = tmp_path / name
    shutil.copytree(LORA / name, d)
    cfg = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**cfg, **changes}))
    return d


def test_adapter_of_another_base_is_a_shape_mismatch():
    assert "adapter of another base" in _load("llama", LORA / "qwen3-a")


def test_gguf_adapter_of_another_architecture():
    assert "adapter for qwen3 models, the base is llama" in _load("llama", LORA / "qwen3-a.gguf")


def test_missing_file():
    assert "no such LoRA adapter" in _load("llama", LORA / "absent-adapter")


def test_folder_without_weights(tmp_path):
    d = _edited(tmp_path, "llama-b")
    (d / "adapter_model.safetensors").unlink()
    assert "no adapter_model.safetensors" in _load("llama", d)


def test_unknown_target_module(tmp_path):
    from safetensors.torch import load_file, save_file

    d = _edited(tmp_path, "llama-b")
    w = load_file(d / "adapter_model.safetensors")
    w = {k.replace("self_attn.q_proj", "self_attn.rotary_proj"): v for k, v in w.items()}
    save_file(w, d / "adapter_model.safetensors")
    assert "unknown target module" in _load("llama", d)


@pytest.mark.parametrize("r", [0, 3])
def test_bad_rank(tmp_path, r):
    assert "bad rank" in _load("llama", _edited(tmp_path, "llama-b", r=r))


@pytest.mark.parametrize(
    ("change", "words"),
    [({"use_dora": True}, "DoRA"), ({"peft_type": "IA3"}, "PEFT type 'IA3'"),
     ({"lora_bias": True}, "'lora_bias'")],
)  # fmt: skip
def test_other_peft_kinds(tmp_path, change, words):
    assert words in _load("llama", _edited(tmp_path, "llama-b", **change))


def test_unknown_adapter_id_in_a_request():
    bad = r"lora id 3 is not a loaded adapter \(0\.\.0\)"
    with (
        LLM(str(HF / "llama"), lora=(LoraSpec(str(LORA / "llama-b")),)) as llm,
        pytest.raises(ValueError, match=bad),
    ):
        llm.generate([[1, 2, 3]], SamplingParams(lora=[(3, 1.0)]))


def test_cli_run_says_one_line(tmp_path):
    cmd = [sys.executable, "-m", "localllm.app", "run", "-m", str(HF / "llama"),
           "--lora", str(LORA / "qwen3-a"), "-n", "2", "hello"]  # fmt: skip
    env = {"PYTHONSAFEPATH": "1", "HF_HUB_OFFLINE": "1", "XDG_CONFIG_HOME": str(tmp_path),
           "XDG_DATA_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("localllm: error:"), r.stderr
    assert "adapter of another base" in lines[0]


def _gguf_lora(path, tensors: dict) -> None:
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(path, "llama")
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 8.0)
    for name, shape in tensors.items():
        w.add_tensor(name, np.zeros(shape, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_unknown_target_and_bad_rank(tmp_path):
    unknown = tmp_path / "unknown.gguf"
    _gguf_lora(unknown, {"blk.0.attn_foo.weight.lora_a": (8, 32),
                         "blk.0.attn_foo.weight.lora_b": (32, 8)})  # fmt: skip
    assert "unknown target module 'blk.0.attn_foo'" in _load("llama", unknown)
    bad = tmp_path / "rank.gguf"
    _gguf_lora(bad, {"blk.0.attn_q.weight.lora_a": (8, 32),
                     "blk.0.attn_q.weight.lora_b": (32, 4)})  # fmt: skip
    assert "bad rank" in _load("llama", bad)


def test_a_model_gguf_is_not_an_adapter():
    assert "not a LoRA adapter GGUF" in _load("llama", HF / "qwen3.gguf")


def test_lora_modules_forms():
    from localllm.app.serve import _lora_module

    assert _lora_module("sql=/a/b") == ("sql", "/a/b")
    assert _lora_module('{"name": "sql", "path": "/a/b", "base_model_name": "x"}') == (
        "sql",
        "/a/b",
    )
    for bad in ("sql", "=/a", '{"name": "sql"}', "{oops"):
        with pytest.raises(ValueError, match="--lora-modules"):
            _lora_module(bad)
