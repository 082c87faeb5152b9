"""Hugging Face `Qwen2ForCausalLM` folders as the `qwen2` family: the converter's generic
mapping alone (Q/K/V biases included; NEOX rope needs no permutation)."""

from localllm.engine.hf.config import HFConfig, base_metadata
from localllm.engine.hf.plan import TensorPlan

ARCH = "qwen2"


def metadata(cfg: HFConfig) -> dict:
    return base_metadata(cfg, ARCH)


def adapt(plan: TensorPlan, cfg: HFConfig, n_vocab: int | None) -> None:
    """Nothing to change."""
