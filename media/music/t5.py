"""The T5 text encoder that conditions MusicGen: token ids to text states (plain torch).

T5 specifics kept from the reference: RMS norms without mean or bias, no 1/sqrt(d) on the
attention scores, and one relative position bias (bucketed by distance, from the first block)
added in every block. It runs once per generation, so there is no second, faster path.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from localllm.media.music.config import T5Args
from localllm.media.music.weights import Weights

_ACT = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


def position_buckets(q_len: int, k_len: int, num_buckets: int, max_distance: int) -> torch.Tensor:
    """T5's bidirectional bucket of each (query, key) distance: exact for small distances,
    logarithmic up to `max_distance`, one bucket beyond."""
    rel = torch.arange(k_len)[None, :] - torch.arange(q_len)[:, None]
    half = num_buckets // 2
    buckets = (rel > 0).long() * half
    rel = rel.abs()
    exact = half // 2
    large = (
        exact
        + (
            torch.log(rel.float().clamp(min=1) / exact)
            / math.log(max_distance / exact)
            * (half - exact)
        ).long()
    )
    large = large.clamp(max=half - 1)
    return buckets + torch.where(rel < exact, rel, large)


class T5Encoder:
    """The encoder stack of a T5 checkpoint under `prefix` (`text_encoder.`)."""

    def __init__(self, args: T5Args, w: Weights, prefix: str = "text_encoder."):
        self.args = args
        d, inner = args.d_model, args.num_heads * args.d_kv
        embed = w.first(f"{prefix}shared.weight", f"{prefix}encoder.embed_tokens.weight")
        self.embed = w.get(embed, (args.vocab_size, d))
        p = f"{prefix}encoder.block."
        self.rel_bias = w.get(
            f"{p}0.layer.0.SelfAttention.relative_attention_bias.weight",
            (args.num_buckets, args.num_heads),
        )
        self.blocks = []
        for i in range(args.num_layers):
            a, f = f"{p}{i}.layer.0.", f"{p}{i}.layer.1."
            block = {
                "ln1": w.get(f"{a}layer_norm.weight", (d,)),
                "qkv": torch.cat(
                    [w.get(f"{a}SelfAttention.{n}.weight", (inner, d)) for n in "qkv"]
                ),
                "o": w.get(f"{a}SelfAttention.o.weight", (d, inner)),
                "ln2": w.get(f"{f}layer_norm.weight", (d,)),
                "wo": w.get(f"{f}DenseReluDense.wo.weight", (d, args.d_ff)),
            }
            if args.gated:
                block["wi_0"] = w.get(f"{f}DenseReluDense.wi_0.weight", (args.d_ff, d))
                block["wi_1"] = w.get(f"{f}DenseReluDense.wi_1.weight", (args.d_ff, d))
            else:
                block["wi"] = w.get(f"{f}DenseReluDense.wi.weight", (args.d_ff, d))
            self.blocks.append(block)
        self.final_ln = w.get(f"{prefix}encoder.final_layer_norm.weight", (d,))

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return weight * (x * torch.rsqrt(variance + self.args.eps)).to(x.dtype)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Text states (batch, tokens, d_model) of `ids` (batch, tokens); `mask` 1 = real token."""
        a = self.args
        b, n = ids.shape
        x = F.embedding(ids.to(self.embed.device), self.embed)
        buckets = position_buckets(n, n, a.num_buckets, a.max_distance).to(x.device)
        bias = F.embedding(buckets, self.rel_bias).permute(2, 0, 1)[None]  # (1, heads, n, n)
        if mask is not None:
            keep = mask.to(device=x.device, dtype=torch.bool)[:, None, None, :]
            bias = bias.masked_fill(~keep, torch.finfo(x.dtype).min)
        act = _ACT[a.act]
        for blk in self.blocks:
            h = self._norm(x, blk["ln1"])
            q, k, v = (h @ blk["qkv"].T).view(b, n, 3, a.num_heads, a.d_kv).permute(2, 0, 3, 1, 4)
            scores = q @ k.transpose(-1, -2) + bias  # T5 does not scale the scores
            att = scores.float().softmax(-1).to(x.dtype) @ v
            x = x + att.transpose(1, 2).reshape(b, n, -1) @ blk["o"].T
            h = self._norm(x, blk["ln2"])
            if a.gated:
                h = act(h @ blk["wi_0"].T) * (h @ blk["wi_1"].T)
            else:
                h = act(h @ blk["wi"].T)
            x = x + h @ blk["wo"].T
        return self._norm(x, self.final_ln)
