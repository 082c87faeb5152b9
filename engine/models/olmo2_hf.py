"""Hugging Face `Olmo2ForCausalLM` folders as the `olmo2` family.

As llama.cpp's converter (`Olmo2Model`): tensors as stored (NEOX rope, no permutation); the
post-attention and post-feed-forward norms and the whole-projection q/k norms map by gguf-py's
table. An Olmo 3 config (sliding-window layers) is written as such and refused by `olmo2.py`.
"""

from localllm.engine.hf.config import HFConfig, base_metadata
from localllm.engine.hf.plan import TensorPlan

ARCH = "olmo2"


def metadata(cfg: HFConfig) -> dict:
    meta = base_metadata(cfg, ARCH)
    if cfg.get("sliding_window"):
        meta[f"{ARCH}.attention.sliding_window"] = cfg.get("sliding_window")
    return {k: v for k, v in meta.items() if v is not None}


def adapt(plan: TensorPlan, cfg: HFConfig, n_vocab: int | None) -> None:
    """Nothing to change: the tensors run as stored."""
