"""Record the hybrid-family fixtures: tiny random-weight LFM2 (short convolutions + attention) and
Granite 4.0-H (Mamba-2 + attention; MoE with a shared expert, and dense) models made with
transformers, converted by llama.cpp's own `convert_hf_to_gguf.py`, with transformers' fp32
outputs as goldens.

The method and the files are `record_family_fixtures.py`'s (F16 GGUF + JSON golden in
tests/data/families/, weights drawn with seed 0 and rounded to float16, the real chat template's
renders); this script adds the families and their weight draw:

    python tests/tools/record_hybrid_fixtures.py --llama-cpp /path/to/llama.cpp [--only NAME,..]

transformers computes the recurrences with its torch fallbacks (no causal-conv1d, no mamba-ssm
installed): the chunked SSD scan over the prompt, the recurrent step per generated token. That is
the reference recorded here. Never imports localllm.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record_family_fixtures as rff
from family_specs import CHAT, TOOL_CHAT, WEATHER_TOOL, Family

_LFM2_TOKENS = [
    ("<|pad|>", True),
    ("<|startoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|tool_list_start|>", True),
    ("<|tool_list_end|>", True),
    ("<|tool_call_start|>", True),
    ("<|tool_call_end|>", True),
    ("<|tool_response_start|>", True),
    ("<|tool_response_end|>", True),
    ("<think>", False),
    ("</think>", False),
]
_GRANITE_TOKENS = [
    ("<|end_of_text|>", True),
    ("<|pad|>", True),
    ("<|start_of_role|>", True),
    ("<|end_of_role|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    *((f"<|fim_{t}|>", True) for t in ("prefix", "middle", "suffix", "pad")),  # 152 in all
]
_RENDERS = {
    "chat": {"messages": CHAT},
    "tools": {"messages": TOOL_CHAT, "tools": [WEATHER_TOOL]},
}

# Granite 4.0-H: layers 0, 1, 3 Mamba-2, 2 attention without rope ("nope"); four SSM heads of
# 16 in two groups (grouped B/C, the gated norm per group); Granite's four multipliers away from
# 1 so each one shows; MoE: 4 experts, top 2, plus the shared MLP.
_GRANITE = {
    "hidden_size": 32,
    "intermediate_size": 16,
    "shared_intermediate_size": 32,
    "num_hidden_layers": 4,
    "layer_types": ["mamba", "mamba", "attention", "mamba"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "mamba_n_heads": 4,
    "mamba_d_head": 16,
    "mamba_n_groups": 2,
    "mamba_d_state": 8,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 16,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "position_embedding_type": "nope",
    "embedding_multiplier": 1.5,
    "attention_multiplier": 0.3,
    "residual_multiplier": 0.9,
    "logits_scaling": 0.5,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}

FAMILIES: dict[str, Family] = {
    # LFM2: layers 0, 1, 3 short convolutions (a 3-tap causal conv, gated by B and C), 2 attention
    # with q/k norms; the FFN width given outright (no auto-adjust)
    "lfm2": Family(
        "Lfm2Config",
        "Lfm2ForCausalLM",
        {
            "hidden_size": 32,
            "intermediate_size": 32,
            "block_auto_adjust_ff_dim": False,
            "num_hidden_layers": 4,
            "layer_types": ["conv", "conv", "full_attention", "conv"],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "conv_L_cache": 3,
            "conv_bias": False,
            "norm_eps": 1e-5,
            "rope_theta": 1e6,
            "max_position_embeddings": 2048,
            "tie_word_embeddings": True,
        },
        "LFM2-8B-A1B.jinja",  # LFM2's template (tool list markers; the 1.2B ships the same)
        pre="lfm2",
        added=_LFM2_TOKENS,
        special={
            "bos_token": "<|startoftext|>",
            "eos_token": "<|im_end|>",
            "pad_token": "<|pad|>",
        },
        renders=_RENDERS,
    ),
    # LFM2-8B-A1B's shape: layer 0 dense, the others 8 experts (top 2) with sigmoid routing
    # and a learned choice bias
    "lfm2moe": Family(
        "Lfm2MoeConfig",
        "Lfm2MoeForCausalLM",
        {
            "hidden_size": 32,
            "intermediate_size": 32,
            "moe_intermediate_size": 16,
            "num_hidden_layers": 4,
            "layer_types": ["conv", "conv", "full_attention", "conv"],
            "num_dense_layers": 1,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "use_expert_bias": True,
            "norm_topk_prob": True,
            "routed_scaling_factor": 1.0,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "conv_L_cache": 3,
            "conv_bias": False,
            "norm_eps": 1e-5,
            "rope_theta": 1e6,
            "max_position_embeddings": 2048,
            "tie_word_embeddings": True,
        },
        "LFM2-8B-A1B.jinja",
        pre="lfm2",
        added=_LFM2_TOKENS,
        special={
            "bos_token": "<|startoftext|>",
            "eos_token": "<|im_end|>",
            "pad_token": "<|pad|>",
        },
        renders=_RENDERS,
    ),
    "granitehybrid": Family(
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        _GRANITE,
        "ibm-granite-granite-4.0.jinja",
        pre="llama-bpe",  # the tiny tokenizer's split regex
        added=_GRANITE_TOKENS,
        special={
            "bos_token": "<|end_of_text|>",
            "eos_token": "<|end_of_text|>",
            "pad_token": "<|pad|>",
        },
        renders=_RENDERS,
    ),
    # Granite 4.0-H-Micro's shape: no experts, the shared MLP is the dense FFN (its width is
    # `intermediate_size` too, as llama.cpp reads feed_forward_length for it)
    "granitehybrid_dense": Family(
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        {**_GRANITE, "num_local_experts": 0, "num_experts_per_tok": 0, "intermediate_size": 32},
        "ibm-granite-granite-4.0.jinja",
        pre="llama-bpe",
        added=_GRANITE_TOKENS,
        special={
            "bos_token": "<|end_of_text|>",
            "eos_token": "<|end_of_text|>",
            "pad_token": "<|pad|>",
        },
        renders={"chat": _RENDERS["chat"]},
    ),
}

_plain_randomize = rff.randomize


@torch.no_grad()
def randomize(model, family: Family) -> None:
    """`record_family_fixtures.randomize`, then Mamba-2's own: A_log = log(U(0.02, 0.5)) (decay
    exp(-dt e^A_log) of ~0.6-0.99 a token: the state remembers across a prompt and its chunks);
    LFM2-MoE's expert choice bias N(0, 0.2^2); rounded to float16 again."""
    _plain_randomize(model, family)
    g = torch.Generator().manual_seed(rff.SEED + 2)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.log(0.02 + 0.48 * torch.rand(p.shape, generator=g)))
            p.copy_(p.half().float())
    for name, b in model.named_buffers():
        if name.endswith("expert_bias"):  # LFM2-MoE's learned choice bias (a buffer, zeros)
            b.copy_((0.2 * torch.randn(b.shape, generator=g)).half().float())


_plain_tokenizer = rff.build_tokenizer


def build_tokenizer(family: Family, template: str, out: Path):
    """The converter pads a Mamba-2 vocabulary to a multiple of 8 (Granite's 100352 is one):
    the tiny one must be one too, or the GGUF's token list outgrows its embedding."""
    tok = _plain_tokenizer(family, template, out)
    if family.config_class.startswith("GraniteMoeHybrid") and len(tok) % 8:
        raise SystemExit(f"the tiny Granite vocabulary has {len(tok)} tokens, not a multiple of 8")
    return tok


_plain_convert = rff.convert
# transformers 5 saves Granite's layer types under its own names; the checkpoints (and the
# converter, which reads config.json) name them "mamba" and "attention"
_HUB_LAYER_TYPES = {"linear_attention": "mamba", "full_attention": "attention"}


def convert(llama_cpp: Path, hf_dir: Path, pre: str, out: Path) -> None:
    path = hf_dir / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    if config.get("model_type") == "granitemoehybrid":
        config["layer_types"] = [_HUB_LAYER_TYPES.get(t, t) for t in config["layer_types"]]
        path.write_text(json.dumps(config, indent=2), encoding="utf-8")
    _plain_convert(llama_cpp, hf_dir, pre, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp checkout or export")
    ap.add_argument("--only", help="comma-separated family names (default: all)")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(FAMILIES)
    torch.set_num_threads(1)
    rff.randomize = randomize  # record_family draws through the module's names
    rff.build_tokenizer = build_tokenizer
    rff.convert = convert
    rff.OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            path = rff.record_family(name, FAMILIES[name], args.llama_cpp, Path(tmp))
            print(f"wrote {path} and {path.with_suffix('.gguf').name}")


if __name__ == "__main__":
    main()
