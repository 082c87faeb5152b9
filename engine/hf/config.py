"""A Hugging Face `config.json` read into the GGUF metadata a family's `ModelArgs.from_gguf` takes.

`HFConfig` wraps the JSON (a multimodal config's `text_config` merged to the top, as llama.cpp's
converter does) with `find(*keys)` over the names different model types use; `rope` is the
rope parameters in one form whichever transformers version wrote them (`rope_parameters`,
or the older `rope_theta` + `rope_scaling`). `base_metadata` writes the keys every decoder shares
(llama.cpp's `TextModel.set_gguf_parameters`); a family adds its own in its `*_hf.py` module.
Pre-quantized checkpoints are refused here, naming the format.
"""

import math
from typing import Any

# `quantization_config.quant_method` -> the name users know the format by
QUANT_FORMATS = {
    "awq": "AWQ",
    "gptq": "GPTQ",
    "bitsandbytes": "bitsandbytes",
    "fp8": "FP8",
    "compressed-tensors": "compressed-tensors",
    "aqlm": "AQLM",
    "hqq": "HQQ",
    "eetq": "EETQ",
    "quanto": "quanto",
    "torchao": "torchao",
    "mxfp4": "MXFP4",
    "bitnet": "BitNet",
    "fbgemm_fp8": "FP8 (fbgemm)",
    "exl2": "EXL2",
    "higgs": "HIGGS",
    "vptq": "VPTQ",
    "spqr": "SpQR",
}


class HFConfigError(ValueError):
    """A config.json we cannot run (the caller adds the folder)."""


class HFConfig:
    """config.json as a dict, with lookups over alternative key names."""

    def __init__(self, raw: dict[str, Any]):
        if not isinstance(raw, dict):
            raise HFConfigError("config.json is not a JSON object")
        text = raw.get("text_config")
        self.raw = {**raw, **text} if isinstance(text, dict) else dict(raw)
        arches = raw.get("architectures")
        if not (isinstance(arches, list) and arches and isinstance(arches[0], str)):
            raise HFConfigError("config.json names no 'architectures'")
        self.architecture: str = arches[0]
        self.rope: dict[str, Any] = _rope(self.raw)

    def get(self, key: str, default: Any = None) -> Any:
        value = self.raw.get(key)
        return default if value is None else value

    def find(self, *keys: str, default: Any = None) -> Any:
        for k in keys:
            if self.raw.get(k) is not None:
                return self.raw[k]
        return default

    def require(self, *keys: str) -> Any:
        value = self.find(*keys)
        if value is None:
            raise HFConfigError(f"config.json lacks {keys[0]!r}")
        return value

    @property
    def head_dim(self) -> int:
        """`head_dim`, else hidden_size / num_attention_heads."""
        hd = self.get("head_dim")
        if hd is not None:
            return hd
        heads = self.require("num_attention_heads")
        if type(heads) is not int or heads < 1:
            raise HFConfigError(f"config.json 'num_attention_heads' is {heads!r}")
        return self.require("hidden_size") // heads

    @property
    def tied(self) -> bool:
        return bool(self.get("tie_word_embeddings", False))


def check_not_prequantized(raw: dict[str, Any]) -> None:
    """A checkpoint quantized by a library (AWQ, GPTQ, ...): one line naming the format."""
    q = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    if not q:
        return
    method = str(q.get("quant_method", "unknown")) if isinstance(q, dict) else "unknown"
    name = QUANT_FORMATS.get(method.lower(), method)
    raise HFConfigError(
        f"a pre-quantized {name} checkpoint (config.json quantization_config.quant_method = "
        f"{method!r}): localllm runs float weights (F32/F16/BF16), quantized at load with "
        "--quantize; use the original float checkpoint or a GGUF of this model"
    )


def _rope(raw: dict[str, Any]) -> dict[str, Any]:
    """The rope parameters of the full-attention layers, in transformers 5's form; the
    sliding-window layers' rope base, when they have their own, as `local_rope_theta`."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    params = dict(params) if isinstance(params, dict) else {}
    local = None
    if isinstance(params.get("full_attention"), dict):  # per layer type (Gemma 3)
        local = (params.get("sliding_attention") or {}).get("rope_theta")
        params = dict(params["full_attention"])
    if "rope_type" not in params and "type" in params:
        params["rope_type"] = params["type"]
    for key in ("rope_theta", "partial_rotary_factor", "original_max_position_embeddings"):
        if params.get(key) is None and raw.get(key) is not None:
            params[key] = raw[key]
    local = local or raw.get("rope_local_base_freq")
    if local is not None:
        params["local_rope_theta"] = local
    return params


def base_metadata(cfg: HFConfig, arch: str) -> dict[str, Any]:
    """The GGUF keys llama.cpp's converter writes for every text decoder."""
    meta: dict[str, Any] = {"general.architecture": arch}

    def put(key: str, value: Any) -> None:
        if value is not None:
            meta[f"{arch}.{key}"] = value

    put("block_count", cfg.find("num_hidden_layers", "n_layer", "num_layers"))
    put("context_length", cfg.find("max_position_embeddings", "n_positions", "max_length"))
    put("embedding_length", cfg.find("hidden_size", "n_embd"))
    put("feed_forward_length", cfg.find("intermediate_size", "n_inner"))
    put("attention.head_count", cfg.find("num_attention_heads", "n_head"))
    put("attention.head_count_kv", cfg.find("num_key_value_heads", "n_kv_heads"))
    put("attention.layer_norm_rms_epsilon", cfg.find("rms_norm_eps", "norm_eps"))
    put("expert_count", cfg.find("num_local_experts", "num_experts"))
    put("expert_used_count", cfg.find("num_experts_per_tok"))
    put("attention.key_length", cfg.get("head_dim"))
    put("attention.value_length", cfg.get("head_dim"))
    rope = cfg.rope
    put("rope.freq_base", rope.get("rope_theta"))
    kind, factor = str(rope.get("rope_type", "default")).lower(), rope.get("factor")
    if kind == "linear" and factor is not None:
        put("rope.scaling.type", "linear")
        put("rope.scaling.factor", factor)
    elif kind == "yarn" and factor is not None:
        put("rope.scaling.type", "yarn")
        put("rope.scaling.factor", factor)
        put("rope.scaling.original_context_length", rope.get("original_max_position_embeddings"))
        put("rope.scaling.attn_factor", rope.get("attention_factor", rope.get("attn_factor")))
        put("rope.scaling.yarn_beta_fast", rope.get("beta_fast"))
        put("rope.scaling.yarn_beta_slow", rope.get("beta_slow"))
    elif kind in ("longrope", "su"):
        put("rope.scaling.type", "longrope")
    elif kind not in ("default", "llama3"):
        raise HFConfigError(f"config.json rope type {kind!r} is not supported")
    return meta


def llama3_rope_factors(cfg: HFConfig) -> list[float] | None:
    """Llama 3.1's per-frequency rope divisors (llama.cpp's `rope_freqs` tensor), or None;
    computed in float32 as the converter does, so both paths hold the same values."""
    import torch

    rope = cfg.rope
    if str(rope.get("rope_type", "")).lower() != "llama3":
        return None
    base = rope.get("rope_theta", 10000.0)
    dim = cfg.head_dim
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_ctx = rope.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(float(factor))
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(float(1 / ((1 - smooth) / factor + smooth)))
    return out
