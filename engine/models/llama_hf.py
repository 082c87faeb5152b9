"""Hugging Face `LlamaForCausalLM` / `MistralForCausalLM` folders as the `llama` family.

What llama.cpp's converter (`LlamaModel`) does, done at load: Q and K rows permuted from
transformers' rotate-half rope layout to the interleaved pairs `llama.py` rotates; Llama 3.1's
rope frequency factors made from config.json as the `rope_freqs` tensor.
"""

import torch

from localllm.engine.hf.config import HFConfig, base_metadata, llama3_rope_factors
from localllm.engine.hf.plan import TensorPlan

ARCH = "llama"


def metadata(cfg: HFConfig) -> dict:
    meta = base_metadata(cfg, ARCH)
    meta[f"{ARCH}.rope.dimension_count"] = cfg.head_dim
    meta[f"{ARCH}.vocab_size"] = cfg.get("vocab_size")
    return {k: v for k, v in meta.items() if v is not None}


def rope_permute(n_head: int):
    """The converter's `LlamaModel.permute`: each head's rows [first half; second half] ->
    interleaved pairs (row i of the first half, then row i of the second)."""

    def permute(w: torch.Tensor) -> torch.Tensor:
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2)\
            .reshape(w.shape)  # fmt: skip

    return permute


def adapt(plan: TensorPlan, cfg: HFConfig, n_vocab: int | None) -> None:
    n_head = cfg.require("num_attention_heads")
    n_kv = cfg.get("num_key_value_heads", n_head)
    plan.transform(r"blk\.\d+\.attn_q\.(weight|bias)", rope_permute(n_head))
    plan.transform(r"blk\.\d+\.attn_k\.(weight|bias)", rope_permute(n_kv))
    factors = llama3_rope_factors(cfg)
    if factors is not None:
        plan.add("rope_freqs.weight", torch.tensor(factors, dtype=torch.float32))
