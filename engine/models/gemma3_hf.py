"""Hugging Face `Gemma3ForCausalLM` and `Gemma3ForConditionalGeneration` folders (the text
model) as the `gemma3` family.

As llama.cpp's converter (`Gemma3Model`): every RMSNorm weight + 1 (transformers' Gemma3RMSNorm
multiplies by 1 + w, the GGUF stores the sum); the embedding cut to the tokenizer's ids (the
padding rows past them are never a token); Gemma's defaults where config.json omits a key;
the sliding window, its layer pattern and the local layers' own rope base.
"""

from localllm.engine.hf.config import HFConfig, base_metadata
from localllm.engine.hf.plan import TensorPlan

ARCH = "gemma3"
_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
           "model.multi_modal_projector.")  # fmt: skip


def checkpoint_name(name: str) -> str | None:
    """A multimodal checkpoint's text tensors under their causal-LM names, as the converter's
    `Gemma3Model.modify_tensors` does; the vision tower and projector are the mmproj's, skipped."""
    for prefix in ("language_model.model.", "model.language_model."):
        if name.startswith(prefix):
            return "model." + name[len(prefix) :]
    if name.startswith("language_model.lm_head."):
        return name[len("language_model.") :]
    if name.startswith(_VISION):
        return None
    return name


def metadata(cfg: HFConfig) -> dict:
    meta = base_metadata(cfg, ARCH)
    k = f"{ARCH}."
    meta[k + "context_length"] = cfg.get("max_position_embeddings", 131072)
    meta[k + "attention.head_count"] = cfg.get("num_attention_heads", 8)
    meta[k + "attention.head_count_kv"] = cfg.get("num_key_value_heads", 4)
    meta[k + "attention.layer_norm_rms_epsilon"] = cfg.get("rms_norm_eps", 1e-6)
    meta[k + "attention.key_length"] = cfg.get("head_dim", 256)
    meta[k + "attention.value_length"] = cfg.get("head_dim", 256)
    meta[k + "rope.freq_base"] = cfg.rope.get("rope_theta", 1_000_000.0)
    local = cfg.rope.get("local_rope_theta")
    if local is not None:
        meta[k + "rope.freq_base_swa"] = local
    if cfg.get("final_logit_softcapping"):
        meta[k + "final_logit_softcapping"] = cfg.get("final_logit_softcapping")
    pattern = _pattern(cfg)
    if pattern != 1 and cfg.get("sliding_window"):
        meta[k + "attention.sliding_window"] = cfg.get("sliding_window")
        meta[k + "attention.sliding_window_pattern"] = pattern
    return meta


def _pattern(cfg: HFConfig) -> int:
    """Every n-th layer is global: from `layer_types` when given, else `sliding_window_pattern`
    (default 6, as llama.cpp assumes)."""
    types = cfg.get("layer_types")
    if isinstance(types, list) and "full_attention" in types:
        return types.index("full_attention") + 1
    if isinstance(types, list) and types:
        return 0  # every layer local
    return cfg.get("sliding_window_pattern", 6)


def adapt(plan: TensorPlan, cfg: HFConfig, n_vocab: int | None) -> None:
    plan.transform(r".*norm\.weight", lambda w: w + 1.0)
    embd = plan.entries.get("token_embd.weight")
    if embd is not None and n_vocab is not None and n_vocab < embd.shape[0]:
        plan.keep_rows("token_embd.weight", n_vocab)
