"""Hugging Face `Glm4MoeForCausalLM` folders (GLM-4.5, GLM-4.5-Air, GLM-4.6) as the `glm4moe`
family.

As llama.cpp's converter (`Glm4MoeModel`): the blocks are `num_hidden_layers` plus the
checkpoint's NextN layers (`num_nextn_predict_layers`, kept under their `blk.N.nextn.*` names and
never run, see glm4moe.py); rope turns `partial_rotary_factor` (default one half) of each head;
`n_routed_experts`, `moe_intermediate_size`, `n_shared_experts`, `first_k_dense_replace`,
`routed_scaling_factor` and `norm_topk_prob` become the expert keys, with sigmoid gating; the
router's `e_score_correction_bias` is `exp_probs_b.bias`; per-expert tensors are stacked
(`qwen3moe_hf.stack_experts`); shared experts, q/k norms and biases map by gguf-py's table.
No Q/K permutation (GLM's rope is NEOX already).
"""

from localllm.engine.hf.config import HFConfig, HFConfigError, base_metadata
from localllm.engine.hf.plan import TensorPlan
from localllm.engine.models.qwen3moe_hf import stack_experts

ARCH = "glm4moe"
SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def metadata(cfg: HFConfig) -> dict:
    # glm4moe routes over all experts at once (llama.cpp's graph and ours)
    if cfg.get("n_group", 1) != 1 or cfg.get("topk_group", 1) != 1:
        raise HFConfigError(
            f"config.json n_group {cfg.get('n_group')} / topk_group {cfg.get('topk_group')}: "
            "glm4moe routes without groups (1 / 1)"
        )
    meta = base_metadata(cfg, ARCH)
    nextn = cfg.get("num_nextn_predict_layers", 0)
    meta[f"{ARCH}.block_count"] = cfg.require("num_hidden_layers") + nextn
    factor = cfg.rope.get("partial_rotary_factor", 0.5)
    meta[f"{ARCH}.rope.dimension_count"] = int(cfg.head_dim * factor)
    meta[f"{ARCH}.expert_count"] = cfg.get("n_routed_experts")
    meta[f"{ARCH}.expert_feed_forward_length"] = cfg.get("moe_intermediate_size")
    meta[f"{ARCH}.expert_shared_count"] = cfg.get("n_shared_experts")
    meta[f"{ARCH}.leading_dense_block_count"] = cfg.get("first_k_dense_replace")
    meta[f"{ARCH}.expert_gating_func"] = SIGMOID
    meta[f"{ARCH}.expert_weights_scale"] = cfg.get("routed_scaling_factor")
    meta[f"{ARCH}.expert_weights_norm"] = cfg.get("norm_topk_prob")
    meta[f"{ARCH}.nextn_predict_layers"] = nextn
    return {k: v for k, v in meta.items() if v is not None}


def checkpoint_name(name: str) -> str:
    """The router's choice bias under the name gguf-py's table knows (as the converter does)."""
    return name.replace("e_score_correction_bias", "e_score_correction.bias")


def adapt(plan: TensorPlan, cfg: HFConfig, n_vocab: int | None) -> None:
    n_expert = cfg.require("n_routed_experts")
    blocks = cfg.require("num_hidden_layers") + cfg.get("num_nextn_predict_layers", 0)
    for i in range(blocks):
        stack_experts(plan, i, n_expert)
