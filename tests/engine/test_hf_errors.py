"""Hugging Face folders we cannot run: one `ModelLoadError` line that names the folder and what
is wrong (the CLI prints it as `localllm: error: DIR: ...`)."""

import json
import shutil

import pytest

from localllm.engine.hf.safetensors import SafetensorsError, SafetensorsFile
from localllm.engine.llm_engine import LLMEngine
from localllm.engine.loader import ModelLoadError, open_weights
from tests.engine.hf_fixtures import save_tiny


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf_bad")
    return {
        "llama": save_tiny("llama", root / "llama"),
        "qwen2": save_tiny("qwen2", root / "qwen2", shards=True),
    }


@pytest.fixture
def folder(base, tmp_path):
    """copy(family) -> a fresh copy to break."""

    def copy(family="llama"):
        d = tmp_path / family
        shutil.copytree(base[family], d)
        return d

    return copy


def edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def load_error(d, **kw) -> str:
    with pytest.raises(ModelLoadError) as e:
        LLMEngine(str(d), _args(**kw))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(d)), msg
    return msg


def _args(**kw):
    from localllm.engine.config import EngineArgs

    return EngineArgs(**kw)


@pytest.mark.parametrize(
    ("method", "name"),
    [("awq", "AWQ"), ("gptq", "GPTQ"), ("bitsandbytes", "bitsandbytes"), ("fp8", "FP8"),
     ("compressed-tensors", "compressed-tensors")],
)  # fmt: skip
def test_prequantized_checkpoint_names_its_format(folder, method, name):
    d = folder()
    edit_json(d / "config.json", quantization_config={"quant_method": method, "bits": 4})
    assert f"pre-quantized {name} checkpoint" in load_error(d)


def test_unsupported_architecture(folder):
    d = folder()
    edit_json(d / "config.json", architectures=["MambaForCausalLM"])
    msg = load_error(d)
    assert "unsupported architecture 'MambaForCausalLM'" in msg and "LlamaForCausalLM" in msg


def test_missing_config(folder):
    d = folder()
    (d / "config.json").unlink()
    (d / "config.json").mkdir()  # still "a folder with config.json" to model_path; unreadable
    assert "config.json" in load_error(d)


def test_missing_shard(folder):
    d = folder("qwen2")
    victim = sorted(d.glob("model-*.safetensors"))[1]
    victim.unlink()
    msg = load_error(d)
    assert "missing 1 of" in msg and victim.name in msg


def test_index_names_a_tensor_its_shard_lacks(folder):
    d = folder("qwen2")
    index = d / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["model.layers.0.mlp.extra.weight"] = "model-00001-of-00004.safetensors"
    index.write_text(json.dumps(data))
    assert "lacks tensor 'model.layers.0.mlp.extra.weight'" in load_error(d)


def _rewrite(d, fn):
    """Rewrite model.safetensors through `fn(dict of tensors)` (safetensors' own writer)."""
    from safetensors.torch import load_file, save_file

    path = d / "model.safetensors"
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_tensor(folder):
    d = folder()
    _rewrite(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    assert "missing tensors: blk.1.mlp.ffn_up" in load_error(d)


def test_tensor_of_the_wrong_shape(folder):
    import torch

    def shrink(t):
        t["model.layers.0.self_attn.v_proj.weight"] = torch.zeros(8, 32, dtype=torch.bfloat16)

    d = folder()
    _rewrite(d, shrink)
    msg = load_error(d)
    assert "blk.0.attn_v.weight" in msg and "expected shape (16, 32), got (8, 32)" in msg


def test_unexpected_tensor(folder):
    import torch

    d = folder()
    _rewrite(d, lambda t: t.update({"model.layers.0.foo.weight": torch.zeros(4, 4)}))
    assert "unexpected tensor 'model.layers.0.foo.weight'" in load_error(d)


def test_untied_without_lm_head(folder):
    d = folder()
    edit_json(d / "config.json", tie_word_embeddings=False)
    assert "tie_word_embeddings is false but there is no lm_head.weight" in load_error(d)


def test_only_pickle_weights(folder):
    d = folder()
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    assert "only PyTorch pickle weights" in load_error(d)


def test_truncated_safetensors(folder):
    d = folder()
    path = d / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    assert "outside the" in load_error(d)


@pytest.mark.parametrize(
    "raw",
    [b"\x00" * 4, (10**9).to_bytes(8, "little") + b"{}", (4).to_bytes(8, "little") + b"[1,2"],
)
def test_hostile_safetensors_header(tmp_path, raw):
    p = tmp_path / "x.safetensors"
    p.write_bytes(raw)
    with pytest.raises(SafetensorsError, match=str(p)):
        SafetensorsFile(p)


def test_overlapping_tensors(tmp_path):
    header = json.dumps(
        {
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
        }
    ).encode()
    p = tmp_path / "x.safetensors"
    p.write_bytes(len(header).to_bytes(8, "little") + header + b"\x00" * 12)
    with pytest.raises(SafetensorsError, match="overlap"):
        SafetensorsFile(p)


def test_missing_tokenizer(folder):
    d = folder()
    (d / "tokenizer.json").unlink()
    assert "no tokenizer.json" in load_error(d)


def test_unknown_quantize_type(folder):
    assert "--quantize 'q3_k' is not a type we make" in load_error(folder(), quantize="q3_k")


def test_quantize_refused_for_a_gguf(tmp_path):
    with pytest.raises(ModelLoadError, match="--quantize applies to Hugging Face folders"):
        open_weights(tmp_path / "model.gguf", "q8_0")


def test_residency_budget_too_small_is_one_line(folder):
    """Folders take residency plans as GGUFs do (tests/engine/test_hf_moe_residency.py); a
    budget the model cannot fit in fails before any weight is read, in one line."""
    from localllm.offload.residency import ResidencyConfig, ResidencyError

    with pytest.raises(ResidencyError) as e:
        LLMEngine(str(folder()), _args(residency=ResidencyConfig(budget=1024)))
    msg = str(e.value)
    assert "\n" not in msg and "budget 1.00 KiB (given) is too small" in msg, msg


def test_configs_the_graph_cannot_follow_are_refused(folder):
    """A config that would run as another model: SmolLM3 no-rope layers off the every-fourth
    pattern, Gemma 2 with a query scale its graph does not use."""
    d = folder()
    edit_json(d / "config.json", architectures=["SmolLM3ForCausalLM"], no_rope_layers=[1, 0])
    assert "no_rope_layers [1, 0] is not every 4th layer" in load_error(d)
    edit_json(d / "config.json", architectures=["Gemma2ForCausalLM"], head_dim=8,
              query_pre_attn_scalar=64)  # fmt: skip
    assert "query_pre_attn_scalar 64 is not the 8" in load_error(d)
