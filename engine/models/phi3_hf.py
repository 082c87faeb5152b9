"""Hugging Face `Phi3ForCausalLM` folders as the `phi3` family.

As llama.cpp's converter (`Phi3MiniModel`): the fused `qkv_proj` and `gate_up_proj` map to
`attn_qkv` and `ffn_up` as they are; partial rotary from `partial_rotary_factor`; LongRoPE's
long and short factors from config.json as the `rope_factors_long` / `_short` tensors, with
its attention factor.
"""

import math

import torch

from localllm.engine.hf.config import HFConfig, HFConfigError, base_metadata
from localllm.engine.hf.plan import TensorPlan

ARCH = "phi3"


def _rope_dims(cfg: HFConfig) -> int:
    pct = cfg.rope.get("partial_rotary_factor", 1.0)
    return int(pct * cfg.require("hidden_size")) // cfg.require("num_attention_heads")


def metadata(cfg: HFConfig) -> dict:
    meta = base_metadata(cfg, ARCH)
    k = f"{ARCH}."
    ctx = cfg.require("max_position_embeddings")
    orig = cfg.rope.get("original_max_position_embeddings", ctx)
    meta[k + "rope.scaling.original_context_length"] = orig
    meta[k + "rope.dimension_count"] = _rope_dims(cfg)
    meta[k + "attention.sliding_window"] = cfg.get("sliding_window", 0)
    meta.pop(k + "attention.key_length", None)  # the converter writes none for phi3
    meta.pop(k + "attention.value_length", None)
    if cfg.rope.get("long_factor"):
        kind = str(cfg.rope.get("rope_type", "")).lower()
        scale = ctx / orig
        if kind in ("su", "longrope"):
            attn = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0
        elif kind == "yarn":
            attn = 0.1 * math.log(scale) + 1.0 if scale > 1.0 else 1.0
        else:
            raise HFConfigError(f"config.json rope type {kind!r} is not supported for phi3")
        meta[k + "rope.scaling.attn_factor"] = attn
    return meta


def adapt(plan: TensorPlan, cfg: HFConfig, n_vocab: int | None) -> None:
    long, short = cfg.rope.get("long_factor"), cfg.rope.get("short_factor")
    if not long:
        return
    half = _rope_dims(cfg) // 2
    if not short or len(long) != half or len(short) != half:
        raise HFConfigError(
            f"config.json rope long_factor and short_factor need {half} values each"
        )
    plan.add("rope_factors_long.weight", torch.tensor(long, dtype=torch.float32))
    plan.add("rope_factors_short.weight", torch.tensor(short, dtype=torch.float32))
