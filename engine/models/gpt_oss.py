"""The `gpt-oss` GGUF architecture: OpenAI gpt-oss-20b / gpt-oss-120b.

Pre-norm decoder with biased GQA attention, NEOX rope with YaRN (no truncation of the correction
range, as OpenAI's reference), per-head attention sinks (`attn_sinks`), sliding-window attention
on even layers and full attention on odd ones; the FFN norm is `post_attention_norm`. Every FFN
is routed experts (usually MXFP4) with biases, top-k on the biased router logits then softmax
over the k, and the clamped SwiGLU variant (`swiglu_oai`).
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from localllm.engine.layers.linear import QuantLinear
from localllm.engine.layers.rope import RopeConfig, Rotary, yarn_mscale
from localllm.engine.layers.shared import DenseParam, RMSNorm, attention
from localllm.engine.models.common import arch_key
from localllm.engine.models.decoder import Decoder
from localllm.engine.models.hparams import HyperparameterError
from localllm.engine.moe.block import MoEFeedForward
from localllm.engine.moe.expert_tensor import EXPERT_TENSORS


@dataclass(frozen=True)
class ModelArgs:
    arch: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    norm_eps: float
    rope_base: float
    context_length: int
    window: int
    n_expert: int
    n_expert_used: int
    expert_hidden_dim: int
    yarn_factor: float
    yarn_orig_ctx: int
    yarn_beta: tuple[float, float]  # (fast, slow) rotations bounding the ramp

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], vocab_size: int) -> "ModelArgs":
        k = arch_key(meta)
        n_heads = k("attention.head_count")
        dim = k("embedding_length")
        yarn = k("rope.scaling.type", "none") == "yarn"
        ctx = k("context_length", 4096)
        expert_ff = k("expert_feed_forward_length", None) or k("feed_forward_length")
        return cls(
            arch=meta["general.architecture"],
            vocab_size=vocab_size,
            dim=dim,
            n_layers=k("block_count"),
            n_heads=n_heads,
            n_kv_heads=k("attention.head_count_kv", n_heads),
            head_dim=k("attention.key_length", dim // n_heads),
            hidden_dim=expert_ff,
            norm_eps=k("attention.layer_norm_rms_epsilon", 1e-5),
            rope_base=k("rope.freq_base", 150000.0),
            context_length=ctx,
            window=k("attention.sliding_window", 128),
            n_expert=k("expert_count"),
            n_expert_used=k("expert_used_count"),
            expert_hidden_dim=expert_ff,
            # llama.cpp: a factor of 0 is no scaling; the original context defaults to the trained
            yarn_factor=(k("rope.scaling.factor", 1.0) or 1.0) if yarn else 1.0,
            yarn_orig_ctx=k("rope.scaling.original_context_length", ctx) if yarn else 0,
            yarn_beta=(
                float(k("rope.scaling.yarn_beta_fast", 32.0)),
                float(k("rope.scaling.yarn_beta_slow", 1.0)),
            ),
        )

    def check(self) -> None:
        """Every gpt-oss FFN is routed experts (the shared checks: `hparams.check_args`)."""
        if self.n_expert < 1:
            raise HyperparameterError("expert_count is 0: every gpt-oss block has experts")


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, precise: bool):
        super().__init__()
        hd = args.head_dim
        self.args = args
        self.window = args.window if layer % 2 == 0 else None  # llama.cpp swa pattern 2
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.attn_q = QuantLinear(args.dim, args.n_heads * hd, precise)
        self.attn_k = QuantLinear(args.dim, args.n_kv_heads * hd, precise)
        self.attn_v = QuantLinear(args.dim, args.n_kv_heads * hd, precise)
        self.attn_output = QuantLinear(args.n_heads * hd, args.dim, precise)
        self.attn_sinks = DenseParam(args.n_heads)
        self.post_attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = MoEFeedForward(
            layer,
            args.dim,
            args.expert_hidden_dim,
            args.n_expert,
            args.n_expert_used,
            norm_topk_prob=True,  # softmax over the k chosen logits
            act="swiglu_oai",
            precise=precise,
        )

    def forward(self, x, positions, cos_sin, rotary, batch, kv, layer):
        a = self.args
        h = self.attn_norm(x)
        nq, nkv, hd = a.n_heads, a.n_kv_heads, a.head_dim
        q = rotary.apply(self.attn_q(h).reshape(-1, nq, hd), *cos_sin)
        k = rotary.apply(self.attn_k(h).reshape(-1, nkv, hd), *cos_sin)
        v = self.attn_v(h).reshape(-1, nkv, hd)
        o = attention(
            q,
            k,
            v,
            positions,
            batch,
            kv,
            layer,
            scale=hd**-0.5,
            window=self.window,
            sinks=self.attn_sinks.value,
        )
        x = x + self.attn_output(o.reshape(-1, nq * hd))
        return x + self.mlp(self.post_attention_norm(x))


class Model(Decoder):
    tensor_aliases = {  # noqa: RUF012 (a class constant the loader reads)
        **Decoder.tensor_aliases,
        **{n: f"mlp.{n}" for n in ("ffn_gate_inp", *EXPERT_TENSORS)},
    }

    def __init__(self, args: ModelArgs, precise: bool = False):
        blocks = [Block(args, i, precise) for i in range(args.n_layers)]
        super().__init__(args, blocks, precise)

    def finish_load(self, extra: dict[str, torch.Tensor]) -> None:
        """Called by the loader after every tensor is in place."""
        self.tie_output()
        a = self.args
        cfg = RopeConfig(
            a.head_dim,
            a.rope_base,
            neox=True,
            attn_factor=yarn_mscale(a.yarn_factor),
            yarn_factor=a.yarn_factor,
            yarn_orig_ctx=a.yarn_orig_ctx,
            yarn_beta_fast=a.yarn_beta[0],
            yarn_beta_slow=a.yarn_beta[1],
            yarn_truncate=False,
        )
        self.rotary = Rotary(cfg)
        for blk in self.blk:
            blk.mlp.fuse()
