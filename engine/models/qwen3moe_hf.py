"""Hugging Face `Qwen3MoeForCausalLM` folders as the `qwen3moe` family.

As llama.cpp's converter (`Qwen2MoeModel.modify_tensors`): the router `mlp.gate` is
`ffn_gate_inp`; per-expert `mlp.experts.E.{gate,up,down}_proj` are stacked into
`ffn_{gate,up,down}_exps` [experts, rows, cols]; a fused 3-D `mlp.experts.gate_up_proj`
(transformers 5's layout) is split into gate and up. Stacking copies the experts once.
"""

from localllm.engine.hf.config import HFConfig, HFConfigError, base_metadata
from localllm.engine.hf.plan import TensorPlan

ARCH = "qwen3moe"
_PARTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def metadata(cfg: HFConfig) -> dict:
    # llama.cpp's qwen3moe graph (and ours) renormalizes the chosen experts' weights and has
    # an MoE block in every layer: a config that says otherwise would run as another model
    if cfg.get("norm_topk_prob", True) is not True:
        raise HFConfigError("config.json norm_topk_prob false is not supported for qwen3moe")
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise HFConfigError("config.json dense layers (mlp_only_layers, decoder_sparse_step) "
                            "are not supported for qwen3moe")  # fmt: skip
    meta = base_metadata(cfg, ARCH)
    meta[f"{ARCH}.expert_feed_forward_length"] = cfg.get("moe_intermediate_size")
    return {k: v for k, v in meta.items() if v is not None}


def adapt(plan: TensorPlan, cfg: HFConfig, n_vocab: int | None) -> None:
    n_expert = cfg.require("num_experts", "num_local_experts")
    for i in range(cfg.require("num_hidden_layers")):
        stack_experts(plan, i, n_expert)


def stack_experts(plan: TensorPlan, i: int, n_expert: int) -> None:
    """Layer i's routed experts as `ffn_{gate,up,down}_exps` (also glm4moe_hf's): per-expert
    tensors stacked, or transformers 5's fused gate_up split; nothing where it has none."""
    fused = f"model.layers.{i}.mlp.experts.gate_up_proj"
    if fused in plan.entries:  # transformers 5: [experts, 2 * ff, dim]
        plan.split(fused, (f"blk.{i}.ffn_gate_exps.weight", f"blk.{i}.ffn_up_exps.weight"), 1)
        down = f"model.layers.{i}.mlp.experts.down_proj"
        if down in plan.entries:
            plan.entries[f"blk.{i}.ffn_down_exps.weight"] = plan.entries.pop(down)
        return
    for hf, gguf in _PARTS.items():
        parts = [_expert_name(i, e, hf) for e in range(n_expert)]
        if any(p in plan.entries for p in parts):
            plan.stack(parts, f"blk.{i}.{gguf}.weight")


def _expert_name(layer: int, expert: int, part: str) -> str:
    # gguf-py's table has no per-expert names: they keep the checkpoint's own
    return f"model.layers.{layer}.mlp.experts.{expert}.{part}.weight"
