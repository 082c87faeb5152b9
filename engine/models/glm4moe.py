"""The `glm4moe` GGUF architecture: GLM-4.5, GLM-4.5-Air, GLM-4.6 (Z.ai's MoE models).

Follows llama.cpp's glm4moe graph. Attention: Q/K/V with biases, per-head RMSNorm on Q and K when
the file has them (GLM-4.5 / 4.6; not Air), NEOX rope over the first `rope.dimension_count` dims
of each head only (partial rope: half of them), no sliding window. The FFN's norm is stored as
`post_attention_norm` (transformers' name for a pre-FFN norm); the first
`leading_dense_block_count` layers have a dense SwiGLU FFN, the rest routed experts through the
shared MoE block: sigmoid scores, top-k chosen on score + the learned bias `exp_probs_b` but
weighted by the unbiased scores (renormalised when `expert_weights_norm`, times
`expert_weights_scale`), plus always-on shared experts (`ffn_*_shexp`, `expert_shared_count`
times the expert width).

The converter keeps the checkpoint's NextN / multi-token-prediction layers as the last
`nextn_predict_layers` blocks. They are not part of the next-token forward: like llama.cpp, the
model never runs them, and their tensors are neither planned nor loaded (`unused_blocks`).
"""

from dataclasses import dataclass
from typing import Any

import torch

from localllm.engine.layers.rope import RopeConfig, Rotary
from localllm.engine.layers.shared import RMSNorm
from localllm.engine.models import qwen2
from localllm.engine.models.common import arch_key
from localllm.engine.models.decoder import Decoder
from localllm.engine.models.hparams import HyperparameterError
from localllm.engine.moe.block import MoEFeedForward, Routing
from localllm.engine.moe.expert_tensor import EXPERT_TENSORS
from localllm.kernels.fused.heads import HeadNorms

# llama.cpp's expert_gating_func: glm4moe reads "none" (0) as sigmoid, its only router
GATING = {0: "sigmoid", 1: "softmax", 2: "sigmoid"}


@dataclass(frozen=True)
class ModelArgs(qwen2.ModelArgs):
    rope_dims: int
    n_dense: int
    n_expert: int
    n_expert_used: int
    expert_hidden_dim: int
    n_shared: int
    routing: Routing
    norm_topk_prob: bool
    n_nextn: int  # NextN layers after the `n_layers` that run

    @property
    def unused_blocks(self) -> range:
        """The NextN layers' block numbers: never run, never loaded."""
        return range(self.n_layers, self.n_layers + self.n_nextn)

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], vocab_size: int) -> "ModelArgs":
        k = arch_key(meta)
        base = qwen2.ModelArgs.from_gguf(meta, vocab_size)
        fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
        n_nextn = k("nextn_predict_layers", 0)
        fields["n_layers"] = base.n_layers - n_nextn
        gating = k("expert_gating_func", 0)
        routing = Routing(
            scoring=GATING[gating],
            probs_bias=True,  # every glm4moe MoE layer has its exp_probs_b
            n_group=k("expert_group_count", 1),
            topk_group=k("expert_group_used_count", 1),
            scale=k("expert_weights_scale", 1.0),
        )
        return cls(
            **fields,
            rope_dims=k("rope.dimension_count", base.head_dim),  # llama.cpp's default: whole
            n_dense=k("leading_dense_block_count", 0),
            n_expert=k("expert_count"),
            n_expert_used=k("expert_used_count"),
            expert_hidden_dim=k("expert_feed_forward_length"),
            n_shared=k("expert_shared_count", 0),
            routing=routing,
            norm_topk_prob=bool(k("expert_weights_norm", False)),
            n_nextn=n_nextn,
        )

    def check(self) -> None:
        """Relations of glm4moe's own keys (the shared ones: `hparams.check_args`)."""
        if self.n_layers < 1:
            raise HyperparameterError(
                f"nextn_predict_layers is {self.n_nextn}: no layer of "
                f"{self.n_layers + self.n_nextn} blocks is left to run"
            )
        if self.n_dense > self.n_layers:
            raise HyperparameterError(
                f"leading_dense_block_count is {self.n_dense}, more than {self.n_layers} layers"
            )
        if self.n_dense < self.n_layers and self.n_expert < 1:
            raise HyperparameterError("expert_count is 0 but layers past the dense ones are MoE")
        g = self.routing
        if g.n_group != 1 or g.topk_group != 1:  # GLM routes over all experts at once
            raise HyperparameterError(
                f"expert_group_count {g.n_group} / expert_group_used_count {g.topk_group}: "
                "glm4moe routes without groups (1 / 1)"
            )


class Block(qwen2.Block):
    """qwen2's block (biased Q/K/V, NEOX rope, pre-norms) with optional per-head q/k norms and a
    dense or MoE FFN."""

    def __init__(self, args: ModelArgs, layer: int, precise: bool):
        super().__init__(args, precise)
        self.attn_q_norm = RMSNorm(args.head_dim, args.norm_eps)  # optional: Air has none
        self.attn_k_norm = RMSNorm(args.head_dim, args.norm_eps)
        if layer >= args.n_dense:
            self.mlp = MoEFeedForward(
                layer,
                args.dim,
                args.expert_hidden_dim,
                args.n_expert,
                args.n_expert_used,
                args.norm_topk_prob,
                precise=precise,
                routing=args.routing,
                shared_hidden=args.n_shared * args.expert_hidden_dim,
            )
            self.mlp.sum_in_norm = True  # its output is pending until the next norm adds it

    def head_norms(self) -> HeadNorms | None:
        if not self.attn_q_norm.loaded:
            return None
        return HeadNorms(self.attn_q_norm.weight, self.attn_k_norm.weight, self.attn_q_norm.eps)


class Model(Decoder):
    tensor_aliases = {  # noqa: RUF012 (a class constant the loader reads)
        **Decoder.tensor_aliases,
        "post_attention_norm": "ffn_norm",  # GLM's pre-FFN norm
        **{n: f"mlp.{n}" for n in ("ffn_gate_inp", "exp_probs_b", *EXPERT_TENSORS)},
        **{f"ffn_{p}_shexp": f"mlp.shexp.ffn_{p}" for p in ("gate", "up", "down")},
    }

    def __init__(self, args: ModelArgs, precise: bool = False):
        blocks = [Block(args, i, precise) for i in range(args.n_layers)]
        super().__init__(args, blocks, precise)
        norms = (f"blk.{i}.attn_{qk}_norm.weight" for i in range(args.n_layers) for qk in "qk")
        self.optional_tensors = (*Decoder.optional_tensors, *norms)

    def finish_load(self, extra: dict[str, torch.Tensor]) -> None:
        """Called by the loader after every tensor is in place."""
        self.tie_output()
        a = self.args
        for i, blk in enumerate(self.blk):
            if blk.attn_q_norm.loaded != blk.attn_k_norm.loaded:
                raise ValueError(f"blk.{i}: attn_q_norm and attn_k_norm come together, or neither")
        self.rotary = Rotary(RopeConfig(a.rope_dims, a.rope_base, neox=True,
                                        linear_scale=a.rope_linear_scale))  # fmt: skip
        for blk in self.blk:
            blk.fuse()
