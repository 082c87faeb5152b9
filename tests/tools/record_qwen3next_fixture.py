"""Record the qwen3next fixture: a tiny random-weight Qwen3-Next (gated DeltaNet layers, a gated
full-attention layer every fourth, sparse MoE with a gated shared expert) made with transformers,
converted by llama.cpp's own `convert_hf_to_gguf.py`, with transformers' fp32 outputs as goldens.

The method and the files are `record_family_fixtures.py`'s (F16 GGUF + JSON golden in
tests/data/families/, weights drawn with seed 0 and rounded to float16, the real chat template's
renders); this script adds the family and its weight draw:

    python tests/tools/record_qwen3next_fixture.py --llama-cpp /path/to/llama.cpp-export

transformers computes the delta rule with its torch fallbacks (`torch_chunk_gated_delta_rule`
over the prompt, `torch_recurrent_gated_delta_rule` per generated token) when neither
flash-linear-attention nor causal-conv1d is installed: that is the reference recorded here.
Never imports localllm.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record_family_fixtures as rff
from family_specs import CHAT, TOOL_CHAT, WEATHER_TOOL, Family

_QWEN_TOKENS = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<think>", False),
    ("</think>", False),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
]

# Four layers: 0-2 gated DeltaNet, 3 full attention (interval 4). Two key heads serve four value
# heads (grouped, as the 80B's 16 / 32); head_dim 16 with partial rope over a quarter of it.
QWEN3NEXT = Family(
    "Qwen3NextConfig",
    "Qwen3NextForCausalLM",
    {
        "hidden_size": 32,
        "intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "partial_rotary_factor": 0.25,
        "rope_theta": 1e7,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 8,
        "shared_expert_intermediate_size": 16,
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
    },
    "Qwen-Qwen3-0.6B.jinja",  # Qwen3's template: hermes <tool_call> JSON, as Qwen3-Next's
    pre="llama-bpe",  # the tiny tokenizer's split regex (Qwen2's differs only on digit runs)
    added=_QWEN_TOKENS,
    special={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    renders={
        "chat": {"messages": CHAT},
        "tools": {"messages": TOOL_CHAT, "tools": [WEATHER_TOOL]},
        "no_thinking": {"messages": CHAT[1:2], "enable_thinking": False},
    },
    mtp=True,
)

_plain_randomize = rff.randomize


@torch.no_grad()
def randomize(model, family: Family) -> None:
    """`record_family_fixtures.randomize`, then Qwen3-Next's own: its RMSNorms (not the gated
    one) scale by 1 + w, so those weights are drawn around 0; A_log around -2 (decay
    exp(-softplus(.) * e^A_log) ~ 0.8 a token: the state remembers across a prompt); rounded to
    float16 again."""
    _plain_randomize(model, family)
    g = torch.Generator().manual_seed(rff.SEED + 2)
    for name, p in model.named_parameters():
        offset = name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight"))
        if offset or name == "model.norm.weight":
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        elif name.endswith("A_log"):
            p.copy_(-2.0 + 0.5 * torch.randn(p.shape, generator=g))
        p.copy_(p.half().float())


def add_mtp_layer(hf_dir: Path, model) -> None:
    """The multi-token-prediction block Qwen3-Next checkpoints ship as `mtp.*` (transformers
    ignores it; the converter requires it unless told --no-mtp, and keeps it as a NextN layer
    after the last one): a full-attention MoE layer like the last, plus fc and its norms."""
    from safetensors.torch import load_file, save_file

    path = hf_dir / "model.safetensors"
    state = load_file(path)
    g = torch.Generator().manual_seed(rff.SEED + 3)
    prefix = f"model.layers.{model.config.num_hidden_layers - 1}."
    for k in [k for k in state if k.startswith(prefix)]:
        t = state[k]
        noisy = t + 0.1 * torch.randn(t.shape, generator=g)
        state[k.replace(prefix, "mtp.layers.0.")] = noisy.half().float()
    d = model.config.hidden_size
    state["mtp.fc.weight"] = (torch.randn(d, 2 * d, generator=g) / (2 * d) ** 0.5).half().float()
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        state[f"mtp.{n}.weight"] = torch.zeros(d)  # (1 + w) norms
    save_file(state, str(path), metadata={"format": "pt"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp checkout or export")
    args = ap.parse_args()
    torch.set_num_threads(1)
    # record_family draws and appends the NextN layer through the module's names
    rff.randomize = randomize
    rff.add_mtp_layer = add_mtp_layer
    rff.OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = rff.record_family("qwen3next", QWEN3NEXT, args.llama_cpp, Path(tmp))
    print(f"wrote {path} and {path.with_suffix('.gguf').name}")


if __name__ == "__main__":
    main()
