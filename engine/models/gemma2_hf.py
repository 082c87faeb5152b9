"""Hugging Face `Gemma2ForCausalLM` folders as the `gemma2` family.

As llama.cpp's converter (`Gemma2Model`): every RMSNorm weight + 1 (Gemma's norms multiply by
1 + w), the attention and final logit soft-caps and the sliding window from config.json, layers
alternating local/global from the first. The query scale the GGUF cannot say is checked instead:
`query_pre_attn_scalar` must be what `gemma2.py` derives (head_dim, or dim / heads for the 27B).
"""

from localllm.engine.hf.config import HFConfig, HFConfigError, base_metadata
from localllm.engine.hf.plan import TensorPlan
from localllm.engine.models.gemma2 import N_LAYERS_27B

ARCH = "gemma2"


def metadata(cfg: HFConfig) -> dict:
    meta = base_metadata(cfg, ARCH)
    k = f"{ARCH}."
    head_dim = cfg.get("head_dim", 256)
    meta[k + "attention.key_length"] = head_dim
    meta[k + "attention.value_length"] = head_dim
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key):
            meta[k + key] = cfg.get(key)
    if cfg.get("sliding_window"):
        meta[k + "attention.sliding_window"] = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if isinstance(types, list) and types != [
        ("sliding" if i % 2 == 0 else "full") + "_attention" for i in range(len(types))
    ]:
        raise HFConfigError("config.json layer_types: gemma2 runs local and global layers "
                            "alternating from the first")  # fmt: skip
    layers = cfg.require("num_hidden_layers")
    dim, heads = cfg.require("hidden_size"), cfg.require("num_attention_heads")
    want = dim // heads if layers == N_LAYERS_27B else head_dim
    scalar = cfg.get("query_pre_attn_scalar", head_dim)
    if scalar != want:
        raise HFConfigError(f"config.json query_pre_attn_scalar {scalar} is not the {want} "
                            "llama.cpp's gemma2 graph (and ours) scales queries by")  # fmt: skip
    return {key: v for key, v in meta.items() if v is not None}


def adapt(plan: TensorPlan, cfg: HFConfig, n_vocab: int | None) -> None:
    plan.transform(r".*norm\.weight", lambda w: w + 1.0)
    plan.drop("output.weight")  # tied: the converter skips lm_head too
    embd = plan.entries.get("token_embd.weight")
    if embd is not None and n_vocab is not None and n_vocab < embd.shape[0]:
        plan.keep_rows("token_embd.weight", n_vocab)
