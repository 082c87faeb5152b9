"""The `qwen3moe` GGUF architecture: Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B).

Qwen3's attention (per-head q/k RMSNorm before NEOX rope, no biases) with every FFN replaced by
routed experts: softmax over `ffn_gate_inp` logits, top `expert_used_count` experts, their
weights renormalised (llama.cpp's qwen3moe graph passes norm_w = true), SwiGLU experts of
`expert_feed_forward_length`. No shared expert.
"""

from dataclasses import dataclass
from typing import Any

from localllm.engine.models import qwen2, qwen3
from localllm.engine.models.common import arch_key
from localllm.engine.models.hparams import HyperparameterError
from localllm.engine.moe.block import MoEFeedForward


@dataclass(frozen=True)
class ModelArgs(qwen2.ModelArgs):
    n_expert: int
    n_expert_used: int
    expert_hidden_dim: int

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], vocab_size: int) -> "ModelArgs":
        k = arch_key(meta)
        # feed_forward_length is the dense size some converters still write; experts have theirs.
        expert_ff = k("expert_feed_forward_length")
        meta = {f"{meta['general.architecture']}.feed_forward_length": expert_ff, **meta}
        base = qwen2.ModelArgs.from_gguf(meta, vocab_size)
        fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
        return cls(
            **fields,
            n_expert=k("expert_count"),
            n_expert_used=k("expert_used_count"),
            expert_hidden_dim=expert_ff,
        )

    def check(self) -> None:
        """Every qwen3moe FFN is routed experts (the shared checks: `hparams.check_args`)."""
        if self.n_expert < 1:
            raise HyperparameterError("expert_count is 0: every qwen3moe block has experts")


class Block(qwen3.Block):
    def __init__(self, args: ModelArgs, precise: bool):
        super().__init__(args, precise)
        self.mlp = MoEFeedForward(
            0,  # the model numbers its layers
            args.dim,
            args.expert_hidden_dim,
            args.n_expert,
            args.n_expert_used,
            norm_topk_prob=True,
            precise=precise,
        )
        self.mlp.sum_in_norm = True  # its output is pending until the next norm adds it


class Model(qwen3.Model):
    tensor_aliases = {  # noqa: RUF012 (a class constant the loader reads)
        "ffn_gate_inp": "mlp.ffn_gate_inp",
        "ffn_gate_exps": "mlp.ffn_gate_exps",
        "ffn_up_exps": "mlp.ffn_up_exps",
        "ffn_down_exps": "mlp.ffn_down_exps",
    }

    block_cls = Block

    def __init__(self, args: ModelArgs, precise: bool = False):
        super().__init__(args, precise)
        for i, blk in enumerate(self.blk):
            blk.mlp.layer = i
