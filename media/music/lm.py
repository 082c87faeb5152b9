"""MusicGen's codebook language model: K code embeddings summed, sinusoidal positions, pre-norm
decoder layers (self-attention, cross-attention to the text states for MusicGen, none for
MusicGen-Melody, whose conditioning is a prefix of the sequence), and one head per codebook.

Two paths over the same weights:
- `reference(x, cross, cross_mask)`: the whole sequence at once, causal mask, attention written
  out as matmul + softmax. Plain and slow (each generation step recomputes everything); the
  fast path is tested against it.
- `forward_cached` over a `KVCache`: self-attention keys/values are written into preallocated
  tensors, cross-attention keys/values are computed once per generation (`cross_kv`), and
  attention is `scaled_dot_product_attention`; on the CPU a step's linears run on the native
  few-row GEMV (`kernels/cpu/float_gemv.c`). Its static form (`pos`) is what a CUDA graph
  captures (`steps.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from localllm.kernels.cpu import float_gemv
from localllm.media.music.config import DecoderArgs
from localllm.media.music.weights import Weights

_ACT = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu,
        "gelu_new": lambda x: F.gelu(x, approximate="tanh")}  # fmt: skip


def sinusoids(length: int, dim: int) -> torch.Tensor:
    """MusicGen's position table: cos then sin halves (tensor2tensor's order)."""
    half = dim // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10000) / (half - 1)))
    angle = torch.arange(length, dtype=torch.float32)[:, None] * freq[None]
    table = torch.cat([angle.cos(), angle.sin()], dim=1)
    return F.pad(table, (0, dim % 2))


@dataclass
class KVCache:
    """Self-attention keys and values of every layer: (layers, batch, heads, max_len, head_dim)."""

    k: torch.Tensor
    v: torch.Tensor
    length: int = 0


class MusicLM:
    """The decoder under `prefix` (`decoder.`) of a MusicGen checkpoint."""

    def __init__(self, args: DecoderArgs, w: Weights, cross: bool, prefix: str = "decoder."):
        self.args, self.cross = args, cross
        h, f, v = args.hidden_size, args.ffn_dim, args.vocab_size
        p = f"{prefix}model.decoder."
        self.embeds = torch.stack(
            [w.get(f"{p}embed_tokens.{k}.weight", (v + 1, h)) for k in range(args.num_codebooks)]
        )
        self.heads = torch.stack(
            [w.get(f"{prefix}lm_heads.{k}.weight", (v, h)) for k in range(args.num_codebooks)]
        )
        self.positions = sinusoids(args.max_positions, h).to(w.device, w.dtype)
        self.layers = []
        for i in range(args.num_layers):
            q = f"{p}layers.{i}."
            lay = {
                "ln1": (w.get(f"{q}self_attn_layer_norm.weight"),
                        w.get(f"{q}self_attn_layer_norm.bias")),
                "qkv": torch.cat([w.get(f"{q}self_attn.{n}_proj.weight", (h, h)) for n in "qkv"]),
                "o": w.get(f"{q}self_attn.out_proj.weight", (h, h)),
                "ln3": (w.get(f"{q}final_layer_norm.weight"), w.get(f"{q}final_layer_norm.bias")),
                "fc1": w.get(f"{q}fc1.weight", (f, h)),
                "fc2": w.get(f"{q}fc2.weight", (h, f)),
            }  # fmt: skip
            if cross:
                lay["ln2"] = (w.get(f"{q}encoder_attn_layer_norm.weight"),
                              w.get(f"{q}encoder_attn_layer_norm.bias"))  # fmt: skip
                lay["xq"] = w.get(f"{q}encoder_attn.q_proj.weight", (h, h))
                # keys/values read the text states (hidden wide, or the text encoder's width
                # when the checkpoint sets cross_attention_hidden_size)
                lay["xkv"] = torch.cat([w.get(f"{q}encoder_attn.{n}_proj.weight") for n in "kv"])
                lay["xo"] = w.get(f"{q}encoder_attn.out_proj.weight", (h, h))
            self.layers.append(lay)
        self.final_ln = (w.get(f"{p}layer_norm.weight"), w.get(f"{p}layer_norm.bias"))
        self.act = _ACT[args.activation]
        # a decode step's few rows on the CPU: one weight read for both CFG rows (torch's
        # float32 GEMM at 2 rows reads at a fraction of the bandwidth of its 1-row GEMV)
        self.gemv = float_gemv.load() if self.embeds.device.type == "cpu" else None
        self.heads_flat = self.heads.reshape(-1, h)  # all codebooks' heads: one matrix

    def mm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x (..., in) @ w (out, in).T, on the native kernel for a step's few rows."""
        rows = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        if self.gemv is not None and flat.shape[0] <= self.gemv.max_rows:
            flat = flat.float().contiguous()
            if self.gemv.supports(flat, w):
                return self.gemv.linear(flat, w).to(x.dtype).view(*rows, w.shape[0])
        return x @ w.T

    # -- shared pieces -----------------------------------------------------------------------

    def embed(self, codes: torch.Tensor) -> torch.Tensor:
        """(batch, K, T) codes (pad = vocab_size) to summed embeddings (batch, T, hidden)."""
        x = self.embeds[0][codes[:, 0]]
        for k in range(1, codes.shape[1]):
            x = x + self.embeds[k][codes[:, k]]
        return x

    def add_positions(self, x: torch.Tensor, start: int) -> torch.Tensor:
        self.ensure_positions(start + x.shape[1])
        return x + self.positions[start : start + x.shape[1]]

    def ensure_positions(self, length: int) -> None:
        if length > self.positions.shape[0]:  # past max_position_embeddings: the table grows
            dev, dt = self.positions.device, self.positions.dtype
            self.positions = sinusoids(length, self.args.hidden_size).to(dev, dt)

    def logits(self, hidden: torch.Tensor, fast: bool = False) -> torch.Tensor:
        """(batch, T, hidden) final states to (batch, K, T, vocab) logits."""
        h = F.layer_norm(hidden, hidden.shape[-1:], *self.final_ln)
        if not fast:
            return torch.einsum("bth,kvh->bktv", h, self.heads)
        b, t, _ = h.shape
        return self.mm(h, self.heads_flat).view(b, t, *self.heads.shape[:2]).permute(0, 2, 1, 3)

    def _heads_split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.args.num_heads, -1).transpose(1, 2)

    def _ffn(self, x: torch.Tensor, lay: dict, mm=None) -> torch.Tensor:
        h = F.layer_norm(x, x.shape[-1:], *lay["ln3"])
        if mm is None:
            return x + self.act(h @ lay["fc1"].T) @ lay["fc2"].T
        return x + mm(self.act(mm(h, lay["fc1"])), lay["fc2"])

    # -- reference: the whole sequence, no cache ----------------------------------------------

    @staticmethod
    def _attend(q, k, v, mask):
        scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2) + mask
        return scores.softmax(-1) @ v

    @torch.inference_mode()
    def reference(
        self,
        x: torch.Tensor,
        cross: torch.Tensor | None = None,
        cross_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (batch, K, T, vocab) for embedded inputs `x` (batch, T, hidden) that already
        carry their positions; `cross` (batch, S, hidden) with `cross_mask` (batch, S; 1 = keep)."""
        b, t, hs = x.shape
        neg = torch.finfo(x.dtype).min
        causal = torch.full((t, t), neg, dtype=x.dtype, device=x.device).triu(1)
        if cross is not None:
            keep = (
                torch.ones(cross.shape[:2], device=x.device) if cross_mask is None else cross_mask
            )
            xmask = torch.zeros(keep.shape, dtype=x.dtype, device=x.device)
            xmask = xmask.masked_fill(keep == 0, neg)[:, None, None, :]
        for lay in self.layers:
            h = F.layer_norm(x, (hs,), *lay["ln1"])
            q, k, v = (self._heads_split(y) for y in (h @ lay["qkv"].T).chunk(3, -1))
            att = self._attend(q, k, v, causal).transpose(1, 2).reshape(b, t, hs)
            x = x + att @ lay["o"].T
            if self.cross and cross is not None:
                h = F.layer_norm(x, (hs,), *lay["ln2"])
                q = self._heads_split(h @ lay["xq"].T)
                k, v = (self._heads_split(y) for y in (cross @ lay["xkv"].T).chunk(2, -1))
                att = self._attend(q, k, v, xmask).transpose(1, 2).reshape(b, t, hs)
                x = x + att @ lay["xo"].T
            x = self._ffn(x, lay)
        return self.logits(x)

    # -- fast path: KV cache ------------------------------------------------------------------

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        a = self.args
        shape = (a.num_layers, batch, a.num_heads, max_len, a.hidden_size // a.num_heads)
        dev, dt = self.embeds.device, self.embeds.dtype
        return KVCache(
            torch.zeros(shape, device=dev, dtype=dt), torch.zeros(shape, device=dev, dtype=dt)
        )

    def cross_kv(self, cross: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's cross-attention keys and values of the text states, computed once."""
        return [
            tuple(self._heads_split(y).contiguous() for y in (cross @ lay["xkv"].T).chunk(2, -1))
            for lay in self.layers
        ]

    @torch.inference_mode()
    def forward_cached(
        self,
        x: torch.Tensor,
        cache: KVCache,
        cross_kv=None,
        cross_rows: int = 0,
        pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final states (batch, T, hidden) of `x` (batch, T, hidden, positions added) that
        follow the `cache.length` positions already cached; the cache is extended.

        Cross-attention runs for the first `cross_rows` rows only: the others are CFG's
        unconditional rows, whose text states are all zero, so their cross-attention (no biases)
        adds exactly zero.

        `pos` (a (1,) long tensor; T = 1) is the static form a CUDA graph captures: the keys and
        values go into the cache at `pos` and attention reads the whole cache under a mask, so
        no shape and no Python number depends on the step (`cache.length` is left alone)."""
        b, t, hs = x.shape
        start, end = cache.length, cache.length + t
        mm = self.mm
        if pos is not None:
            slots = torch.arange(cache.k.shape[3], device=x.device)
            mask = torch.zeros(slots.shape, dtype=x.dtype, device=x.device)
            mask = mask.masked_fill(slots > pos, torch.finfo(x.dtype).min).view(1, 1, 1, -1)
        for i, lay in enumerate(self.layers):
            h = F.layer_norm(x, (hs,), *lay["ln1"])
            q, k, v = (self._heads_split(y) for y in mm(h, lay["qkv"]).chunk(3, -1))
            if pos is not None:
                cache.k[i].index_copy_(2, pos, k)
                cache.v[i].index_copy_(2, pos, v)
                att = F.scaled_dot_product_attention(q, cache.k[i], cache.v[i], attn_mask=mask)
            else:
                cache.k[i, :, :, start:end] = k
                cache.v[i, :, :, start:end] = v
                att = F.scaled_dot_product_attention(
                    q, cache.k[i, :, :, :end], cache.v[i, :, :, :end],
                    is_causal=t > 1 and start == 0,
                ) if t == 1 or start == 0 else self._attend(
                    q, cache.k[i, :, :, :end], cache.v[i, :, :, :end],
                    self._offset_mask(t, start, x),
                )  # fmt: skip
            x = x + mm(att.transpose(1, 2).reshape(b, t, hs), lay["o"])
            if cross_kv is not None and cross_rows:
                h = F.layer_norm(x[:cross_rows], (hs,), *lay["ln2"])
                q = self._heads_split(mm(h, lay["xq"]))
                ck, cv = cross_kv[i]
                att = F.scaled_dot_product_attention(q, ck, cv)
                x[:cross_rows] += mm(att.transpose(1, 2).reshape(cross_rows, t, hs), lay["xo"])
            x = self._ffn(x, lay, mm)
        if pos is None:
            cache.length = end
        return x

    @staticmethod
    def _offset_mask(t: int, start: int, x: torch.Tensor) -> torch.Tensor:
        """Causal mask for `t` new queries after `start` cached positions."""
        full = torch.full((t, start + t), torch.finfo(x.dtype).min, dtype=x.dtype, device=x.device)
        return full.triu(start + 1)
