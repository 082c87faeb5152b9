"""The `lfm2moe` GGUF architecture: Liquid AI's LFM2-8B-A1B (and LFM2-24B-A2B): LFM2's gated short
convolutions and attention layers (`lfm2`) with routed experts after the first dense layers.

Follows llama.cpp's lfm2moe graph: the first `leading_dense_block_count` blocks keep LFM2's
SwiGLU FFN, the others route through the shared MoE block: sigmoid scores of `ffn_gate_inp`, the
top `expert_used_count` chosen on score + the learned bias `exp_probs_b` but weighted by the
unbiased scores, renormalised (llama.cpp's norm_w), times `expert_weights_scale` when the file
sets one; SwiGLU experts of `expert_feed_forward_length`, no shared expert.
"""

from dataclasses import dataclass
from typing import Any

from localllm.engine.models import lfm2
from localllm.engine.models.common import arch_key
from localllm.engine.models.hparams import HyperparameterError
from localllm.engine.moe.block import MoEFeedForward, Routing
from localllm.engine.moe.expert_tensor import EXPERT_TENSORS

# llama.cpp's expert_gating_func: 0 (none) and 2 are sigmoid, the converter writes 2
GATING = {0: "sigmoid", 1: "softmax", 2: "sigmoid"}


@dataclass(frozen=True)
class ModelArgs(lfm2.ModelArgs):
    n_dense: int
    n_expert: int
    n_expert_used: int
    expert_hidden_dim: int
    routing: Routing

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], vocab_size: int) -> "ModelArgs":
        k = arch_key(meta)
        base = lfm2.ModelArgs.from_gguf(meta, vocab_size)
        fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
        return cls(
            **fields,
            n_dense=k("leading_dense_block_count", 0),
            n_expert=k("expert_count"),
            n_expert_used=k("expert_used_count"),
            expert_hidden_dim=k("expert_feed_forward_length"),
            routing=Routing(
                scoring=GATING[k("expert_gating_func", 2)],
                probs_bias=True,  # every lfm2moe MoE layer has its exp_probs_b
                scale=k("expert_weights_scale", 0.0) or 1.0,  # llama.cpp: 0 is none
            ),
        )

    def check(self) -> None:
        """lfm2moe's own relations (lfm2's and the shared ones too)."""
        super().check()
        if self.n_dense > self.n_layers:
            raise HyperparameterError(
                f"leading_dense_block_count is {self.n_dense}, more than {self.n_layers} layers"
            )
        if self.n_dense < self.n_layers and self.n_expert < 1:
            raise HyperparameterError("expert_count is 0 but layers past the dense ones are MoE")


class Block(lfm2.Block):
    def __init__(self, args: ModelArgs, layer: int, kv_layer: int | None, precise: bool):
        super().__init__(args, layer, kv_layer, precise)
        if layer >= args.n_dense:
            self.mlp = MoEFeedForward(
                layer, args.dim, args.expert_hidden_dim, args.n_expert, args.n_expert_used,
                norm_topk_prob=True, precise=precise, routing=args.routing,
            )  # fmt: skip


class Model(lfm2.Model):
    tensor_aliases = {  # noqa: RUF012 (a class constant the loader reads)
        **lfm2.Model.tensor_aliases,
        **{n: f"mlp.{n}" for n in ("ffn_gate_inp", "exp_probs_b", *EXPERT_TENSORS)},
    }
    block_cls = Block
