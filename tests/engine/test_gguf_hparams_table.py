"""The hyperparameter table itself: it covers every key a family reads, and its generic checks
hold on their own (widths bounded by the layers' tensors, kinds refusing wrong types)."""

import ast
import math
from pathlib import Path

import pytest
from gguf import GGUFValueType as VT

import localllm.engine.models as models
from localllm.engine.config import EngineArgs
from localllm.engine.llm_engine import LLMEngine
from localllm.engine.models.hparams import HPARAMS, HyperparameterError, read
from tests.engine.gguf_fixtures import GGUFValue
from tests.engine.hostile_gguf import hparam, write_variant
from tests.engine.load_limits import load_limits


def _keys_read_by_families() -> set[str]:
    """The first argument of every `k("...")` call in engine/models/*.py."""
    names = set()
    for path in Path(models.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "k"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                names.add(node.args[0].value)
    return names


def test_every_key_a_family_reads_is_in_the_table():
    used = _keys_read_by_families()
    assert len(used) > 30  # the scan finds the families' reads
    assert used <= set(HPARAMS), sorted(used - set(HPARAMS))


@pytest.mark.parametrize(
    ("name", "value", "hint"),
    [
        ("block_count", True, "expected an integer"),
        ("block_count", 2.0, "expected an integer"),
        ("attention.head_count", -3, "expected 1.."),
        ("rope.freq_base", "1e4", "expected a number"),
        ("rope.freq_base", 1.0, "finite number in (1,"),
        ("rope.scaling.factor", 0.5, "0 or [1,"),
        ("attention.layer_norm_rms_epsilon", math.inf, "finite"),
        ("expert_weights_norm", 2, "boolean"),
        ("rope.scaling.type", 3, "string"),
        ("expert_gating_func", 3, "0..2"),
    ],
)
def test_kinds_refuse(name, value, hint):
    with pytest.raises(HyperparameterError, match=r"metadata 'llama\.") as e:
        read(f"llama.{name}", name, value)
    assert hint in str(e.value)


def test_kinds_accept():
    assert read("llama.rope.freq_base", "rope.freq_base", 10000) == 10000.0
    assert read("llama.rope.scaling.factor", "rope.scaling.factor", 0.0) == 0.0  # llama.cpp: none
    assert read("gemma3.x", "attention.sliding_window_pattern", [1, 0]) == [1, 0]  # lenient
    assert read("llama.unknown", "unknown", object) is object  # keys no family reads


def test_a_width_beyond_what_the_layers_hold(tmp_path):
    """A head size in range (2^16) but larger than two tiny layers' tensors could hold: refused
    before 2^16-wide norms are built (the check that bounds construction by the file's size)."""
    wide = {hparam("qwen3", "attention.key_length"): GGUFValue(1 << 16, VT.UINT32)}
    path = write_variant(tmp_path / "w.gguf", "qwen3", wide)
    with load_limits(), pytest.raises(ValueError) as e:
        LLMEngine(str(path), EngineArgs(kv_cache_memory=1 << 20))
    assert "attention.key_length' is 65536, more than 2 layers" in str(e.value)
