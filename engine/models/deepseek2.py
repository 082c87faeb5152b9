"""The `deepseek2` GGUF architecture: DeepSeek-V2/V2-Lite/V3/R1 (and Kimi-K2, same graph).

Multi-head latent attention as llama.cpp lays it out: q from `attn_q` or the low-rank
`attn_q_a` -> `attn_q_a_norm` -> `attn_q_b`; a shared compressed kv plus one rope key from
`attn_kv_a_mqa`, the latent normed by `attn_kv_a_norm`; `attn_kv_b` (or the split
`attn_k_b`/`attn_v_b` of newer GGUFs) maps it to per-head keys and values. Rope (NORM pairs,
optional YaRN) touches only the decoupled rope dims. The cache holds the latent, not per-head K/V
(DeepSeek's "absorbed" MLA, as llama.cpp runs it): one cached row of kv_lora + rope values per
token and layer (576 for V3, 43x fewer than 128 heads' expanded K and V), read by every head as
one shared KV head; each head's query is mapped into the latent by k_b, and the attention output,
a latent, back out by v_b.
The first `leading_dense_block_count` layers have a dense FFN, the rest routed experts with
DeepSeek routing and shared experts (`ffn_*_shexp`) through the shared MoE block.
"""

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from localllm.engine.layers.linear import QuantLinear, dense
from localllm.engine.layers.rope import RopeConfig, Rotary, yarn_mscale
from localllm.engine.layers.shared import DenseParam, GatedMLP, RMSNorm, attention
from localllm.engine.models.common import arch_key
from localllm.engine.models.decoder import Decoder
from localllm.engine.models.hparams import HyperparameterError
from localllm.engine.moe.block import MoEFeedForward, Routing
from localllm.engine.moe.expert_tensor import EXPERT_TENSORS

GATING = {0: "softmax", 1: "softmax", 2: "sigmoid"}  # llama.cpp's expert_gating_func


@dataclass(frozen=True)
class ModelArgs:
    arch: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    hidden_dim: int  # dense layers' FFN
    norm_eps: float
    rope_base: float
    context_length: int
    q_lora_rank: int  # 0: a plain attn_q
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int
    split_kv_b: bool  # attn_k_b / attn_v_b instead of attn_kv_b
    n_dense: int
    n_expert: int
    n_expert_used: int
    expert_hidden_dim: int
    n_shared: int
    routing: Routing
    norm_topk_prob: bool
    yarn_factor: float
    yarn_orig_ctx: int
    yarn_log_mul: float
    yarn_beta: tuple[float, float]  # (fast, slow) rotations bounding the ramp

    @property
    def n_kv_heads(self) -> int:
        return 1  # the latent: one KV head shared by every query head

    @property
    def head_dim(self) -> int:
        """Width of a cached K row: the normed latent, then the rope key."""
        return self.kv_lora_rank + self.qk_rope_dim

    @property
    def v_cache_dim(self) -> int:
        """Width of a cached V row: the latent alone."""
        return self.kv_lora_rank

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], vocab_size: int) -> "ModelArgs":
        k = arch_key(meta)
        rope = k("rope.dimension_count")
        split = f"{meta['general.architecture']}.attention.key_length_mla" in meta
        qk = k("attention.key_length_mla") if split else k("attention.key_length")
        v = k("attention.value_length_mla") if split else k("attention.value_length")
        yarn = k("rope.scaling.type", "none") == "yarn"
        ctx = k("context_length", 4096)
        n_group = k("expert_group_count", 1)
        routing = Routing(
            scoring=GATING[k("expert_gating_func", 1)],
            # V3's sigmoid router always ships the choice bias (exp_probs_b); V2's softmax never
            probs_bias=k("expert_gating_func", 1) == 2,
            n_group=n_group,
            topk_group=k("expert_group_used_count", n_group),
            scale=k("expert_weights_scale", 1.0),
        )
        return cls(
            arch=meta["general.architecture"],
            vocab_size=vocab_size,
            dim=k("embedding_length"),
            n_layers=k("block_count"),
            n_heads=k("attention.head_count"),
            hidden_dim=k("feed_forward_length"),
            norm_eps=k("attention.layer_norm_rms_epsilon", 1e-6),
            rope_base=k("rope.freq_base", 10000.0),
            context_length=ctx,
            q_lora_rank=k("attention.q_lora_rank", 0),
            kv_lora_rank=k("attention.kv_lora_rank"),
            qk_nope_dim=qk - rope,
            qk_rope_dim=rope,
            v_head_dim=v,
            split_kv_b=split,
            n_dense=k("leading_dense_block_count", 0),
            n_expert=k("expert_count"),
            n_expert_used=k("expert_used_count"),
            expert_hidden_dim=k("expert_feed_forward_length"),
            n_shared=k("expert_shared_count", 0),
            routing=routing,
            # V2 GGUFs predate the key and never renormalised
            norm_topk_prob=bool(k("expert_weights_norm", False)),
            # llama.cpp: a factor of 0 is no scaling; the original context defaults to the trained
            yarn_factor=(k("rope.scaling.factor", 1.0) or 1.0) if yarn else 1.0,
            yarn_orig_ctx=k("rope.scaling.original_context_length", ctx) if yarn else 0,
            yarn_beta=(
                float(k("rope.scaling.yarn_beta_fast", 32.0)),
                float(k("rope.scaling.yarn_beta_slow", 1.0)),
            ),
            yarn_log_mul=float(k("rope.scaling.yarn_log_multiplier", 0.1)),
        )

    def check(self) -> None:
        """Relations of deepseek2's own keys (the shared ones: `hparams.check_args`)."""
        r, qk = self.qk_rope_dim, self.qk_nope_dim + self.qk_rope_dim
        if self.qk_nope_dim < 1 or r % 2:
            raise HyperparameterError(
                f"rope.dimension_count is {r}, expected an even number below the key length {qk}"
            )
        if not 1 <= self.n_expert_used <= self.n_expert:
            raise HyperparameterError(
                f"expert_used_count is {self.n_expert_used}, expected 1..{self.n_expert} "
                "(expert_count)"
            )
        if self.n_dense > self.n_layers:
            raise HyperparameterError(
                f"leading_dense_block_count is {self.n_dense}, more than {self.n_layers} blocks"
            )
        g = self.routing
        if g.n_group > 1:  # groups of at least two experts, whose two best choices compete
            per = self.n_expert // g.n_group
            if self.n_expert % g.n_group or per < 2:
                raise HyperparameterError(
                    f"expert_group_count is {g.n_group}, expected a divisor of expert_count "
                    f"{self.n_expert} into groups of at least 2"
                )
            if g.topk_group > g.n_group or self.n_expert_used > g.topk_group * per:
                raise HyperparameterError(
                    f"expert_group_used_count is {g.topk_group}: {self.n_expert_used} experts "
                    f"cannot come from {g.topk_group} of {g.n_group} groups of {per}"
                )


class Attention(nn.Module):
    """MLA over a cached latent: per-head queries absorbed into it by k_b, outputs by v_b."""

    def __init__(self, a: ModelArgs, precise: bool):
        super().__init__()
        self.a = a
        qk = a.qk_nope_dim + a.qk_rope_dim
        if a.q_lora_rank:
            self.attn_q_a = QuantLinear(a.dim, a.q_lora_rank, precise)
            self.attn_q_a_norm = RMSNorm(a.q_lora_rank, a.norm_eps)
            self.attn_q_b = QuantLinear(a.q_lora_rank, a.n_heads * qk, precise)
        else:
            self.attn_q = QuantLinear(a.dim, a.n_heads * qk, precise)
        self.attn_kv_a_mqa = QuantLinear(a.dim, a.kv_lora_rank + a.qk_rope_dim, precise)
        self.attn_kv_a_norm = RMSNorm(a.kv_lora_rank, a.norm_eps)
        if a.split_kv_b:
            self.attn_k_b = DenseParam(a.n_heads, a.kv_lora_rank, a.qk_nope_dim)
            self.attn_v_b = DenseParam(a.n_heads, a.v_head_dim, a.kv_lora_rank)
        else:
            rows = a.n_heads * (a.qk_nope_dim + a.v_head_dim)
            self.attn_kv_b = QuantLinear(a.kv_lora_rank, rows, precise)
        self.attn_output = QuantLinear(a.n_heads * a.v_head_dim, a.dim, precise)

    def absorb(self) -> None:
        """k_b [H, kv_lora, nope] and v_b [H, v, kv_lora] as float32 tensors (a merged `attn_kv_b`
        is dequantized once and dropped: the same bytes as the split layout holds)."""
        a = self.a
        if a.split_kv_b:
            k_b, v_b = self.attn_k_b.value.float(), self.attn_v_b.value.float()
        else:
            w = dense(self.attn_kv_b.weight)
            w = w.reshape(a.n_heads, a.qk_nope_dim + a.v_head_dim, a.kv_lora_rank)
            k_b, v_b = w[:, : a.qk_nope_dim].transpose(1, 2).contiguous(), w[:, a.qk_nope_dim :]
            del self.attn_kv_b
        self.register_buffer("k_b", k_b, persistent=False)
        self.register_buffer("v_b", v_b.contiguous(), persistent=False)

    def forward(self, h, positions, cos_sin, rotary, batch, kv, layer, scale):
        a = self.a
        nope, lora = a.qk_nope_dim, a.kv_lora_rank
        if a.q_lora_rank:
            q = self.attn_q_b(self.attn_q_a_norm(self.attn_q_a(h)))
        else:
            q = self.attn_q(h)
        q = q.reshape(-1, a.n_heads, nope + a.qk_rope_dim)
        q_pe = rotary.apply(q[..., nope:].contiguous(), *cos_sin)
        # q_nope . (k_b c) == (k_b^T q_nope) . c: each head's query moved into the latent
        q_lat = torch.einsum("thn,hcn->thc", q[..., :nope].float(), self.k_b).to(q.dtype)
        ckv = self.attn_kv_a_mqa(h)
        latent = self.attn_kv_a_norm(ckv[:, :lora])
        k_pe = rotary.apply(ckv[:, None, lora:].contiguous(), *cos_sin)
        k = torch.cat((latent[:, None], k_pe), -1)  # [T, 1, lora + rope]
        o = attention(torch.cat((q_lat, q_pe), -1), k, latent[:, None], positions, batch, kv, layer,
                      scale=scale)  # fmt: skip
        o = torch.einsum("thc,hvc->thv", o.float(), self.v_b).to(h.dtype)
        return self.attn_output(o.reshape(-1, a.n_heads * a.v_head_dim))


class Block(nn.Module):
    def __init__(self, a: ModelArgs, layer: int, precise: bool):
        super().__init__()
        self.attn_norm = RMSNorm(a.dim, a.norm_eps)
        self.attn = Attention(a, precise)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
        if layer < a.n_dense:
            self.mlp: nn.Module = GatedMLP(a.dim, a.hidden_dim, "silu", precise)
        else:
            shared = a.n_shared * a.expert_hidden_dim
            self.mlp = MoEFeedForward(
                layer,
                a.dim,
                a.expert_hidden_dim,
                a.n_expert,
                a.n_expert_used,
                a.norm_topk_prob,
                precise=precise,
                routing=a.routing,
                shared_hidden=shared,
            )
        self.scale = 1.0

    def forward(self, x, positions, cos_sin, rotary, batch, kv, layer):
        h = self.attn_norm(x)
        x = x + self.attn(h, positions, cos_sin, rotary, batch, kv, layer, self.scale)
        return x + self.mlp(self.ffn_norm(x))


_ATTN = (
    "attn_q",
    "attn_q_a",
    "attn_q_a_norm",
    "attn_q_b",
    "attn_kv_a_mqa",
    "attn_kv_a_norm",
    "attn_kv_b",
    "attn_k_b",
    "attn_v_b",
    "attn_output",
)


class Model(Decoder):
    tensor_aliases = {  # noqa: RUF012 (a class constant the loader reads)
        **Decoder.tensor_aliases,
        **{n: f"attn.{n}" for n in _ATTN},
        **{n: f"mlp.{n}" for n in ("ffn_gate_inp", "exp_probs_b", *EXPERT_TENSORS)},
        **{f"ffn_{p}_shexp": f"mlp.shexp.ffn_{p}" for p in ("gate", "up", "down")},
    }

    def __init__(self, args: ModelArgs, precise: bool = False):
        blocks = [Block(args, i, precise) for i in range(args.n_layers)]
        super().__init__(args, blocks, precise)

    def finish_load(self, extra: dict[str, torch.Tensor]) -> None:
        """Called by the loader after every tensor is in place."""
        self.tie_output()
        a = self.args
        cfg = RopeConfig(
            a.qk_rope_dim,
            a.rope_base,
            neox=False,
            yarn_factor=a.yarn_factor,
            yarn_orig_ctx=a.yarn_orig_ctx,
            yarn_beta_fast=a.yarn_beta[0],
            yarn_beta_slow=a.yarn_beta[1],
        )
        self.rotary = Rotary(cfg)
        # llama.cpp's deepseek2 graph: YaRN's magnitude goes into the score scale, squared
        mscale = yarn_mscale(a.yarn_factor, a.yarn_log_mul)
        scale = mscale * mscale / math.sqrt(a.qk_nope_dim + a.qk_rope_dim)
        for blk in self.blk:
            blk.scale = scale
            blk.attn.absorb()
            blk.mlp.fuse()
