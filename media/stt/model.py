"""Whisper encoder-decoder in plain torch, with a per-request KV cache for the decoder.

Weight names follow this module tree (`encoder.layers.0.attn.q.weight`, ...); the loaders map
each file format onto it. The model knows nothing about decoding or audio pipelines.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class WhisperConfig:
    """Shapes of one Whisper checkpoint (tiny: 384-d, 4+4 layers; base: 512-d, 6+6)."""

    n_mels: int
    n_audio_ctx: int
    n_audio_state: int
    n_audio_head: int
    n_audio_layer: int
    n_vocab: int
    n_text_ctx: int
    n_text_state: int
    n_text_head: int
    n_text_layer: int

    @property
    def multilingual(self) -> bool:
        return self.n_vocab >= 51865


@dataclass
class KVCache:
    """Decoder state for one batch: growing self-attention K/V, fixed cross-attention K/V."""

    cross: list[tuple[torch.Tensor, torch.Tensor]]
    self_kv: list[tuple[torch.Tensor, torch.Tensor] | None] = field(default_factory=list)

    @property
    def length(self) -> int:
        first = self.self_kv[0] if self.self_kv else None
        return 0 if first is None else first[0].shape[2]


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d, bias=False)  # Whisper's key projection has no bias
        self.v = nn.Linear(d, d)
        self.out = nn.Linear(d, d)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        return x.view(b, t, self.heads, d // self.heads).transpose(1, 2)

    def kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.split(self.k(x)), self.split(self.v(x))

    def attend(
        self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_from: int | None = None
    ) -> torch.Tensor:
        q = self.split(self.q(x))
        mask = None
        if causal_from is not None and q.shape[2] > 1:
            # query i sits at absolute position causal_from + i and sees keys up to there
            qi = torch.arange(q.shape[2], device=x.device)[:, None] + causal_from
            mask = torch.arange(k.shape[2], device=x.device)[None, :] <= qi
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        b, h, t, dh = o.shape
        return self.out(o.transpose(1, 2).reshape(b, t, h * dh))


class Mlp(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.attn_ln, self.attn = nn.LayerNorm(d), Attention(d, heads)
        self.mlp_ln, self.mlp = nn.LayerNorm(d), Mlp(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attn_ln(x)
        x = x + self.attn.attend(h, *self.attn.kv(h))
        return x + self.mlp(self.mlp_ln(x))


class DecoderLayer(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.attn_ln, self.attn = nn.LayerNorm(d), Attention(d, heads)
        self.cross_ln, self.cross = nn.LayerNorm(d), Attention(d, heads)
        self.mlp_ln, self.mlp = nn.LayerNorm(d), Mlp(d)

    def forward(
        self,
        x: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None,
        cross: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        h = self.attn_ln(x)
        k, v = self.attn.kv(h)
        start = 0
        if past is not None:
            start = past[0].shape[2]
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        x = x + self.attn.attend(h, k, v, causal_from=start)
        c = self.cross_ln(x)
        b, t, d = c.shape
        if b > 1 and cross[0].shape[0] == 1:
            # beams of one audio share its K/V: their queries attend as one row, no copies
            x = x + self.cross.attend(c.reshape(1, b * t, d), *cross).reshape(b, t, d)
        else:
            x = x + self.cross.attend(c, *cross)
        return x + self.mlp(self.mlp_ln(x)), (k, v)


class Encoder(nn.Module):
    def __init__(self, cfg: WhisperConfig):
        super().__init__()
        d = cfg.n_audio_state
        self.conv1 = nn.Conv1d(cfg.n_mels, d, 3, padding=1)
        self.conv2 = nn.Conv1d(d, d, 3, stride=2, padding=1)
        self.positions = nn.Parameter(torch.empty(cfg.n_audio_ctx, d), requires_grad=False)
        self.layers = nn.ModuleList(
            EncoderLayer(d, cfg.n_audio_head) for _ in range(cfg.n_audio_layer)
        )
        self.ln_post = nn.LayerNorm(d)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """[B, n_mels, 2 * n_audio_ctx] log-mel -> [B, n_audio_ctx, d] audio features."""
        x = F.gelu(self.conv1(mel.to(self.conv1.weight.dtype)))
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        if x.shape[1] != self.positions.shape[0]:
            raise ValueError(
                f"mel gives {x.shape[1]} frames, the encoder takes {len(self.positions)}"
            )
        x = x + self.positions
        for layer in self.layers:
            x = layer(x)
        return self.ln_post(x)


class Decoder(nn.Module):
    def __init__(self, cfg: WhisperConfig):
        super().__init__()
        d = cfg.n_text_state
        self.embed = nn.Embedding(cfg.n_vocab, d)
        self.positions = nn.Parameter(torch.empty(cfg.n_text_ctx, d), requires_grad=False)
        self.layers = nn.ModuleList(
            DecoderLayer(d, cfg.n_text_head) for _ in range(cfg.n_text_layer)
        )
        self.ln = nn.LayerNorm(d)

    def forward(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits [B, T, vocab] for `tokens` [B, T] following `cache.length` earlier ones."""
        start = cache.length
        if start + tokens.shape[1] > self.positions.shape[0]:
            raise ValueError(f"the decoder holds at most {self.positions.shape[0]} tokens")
        x = self.embed(tokens) + self.positions[start : start + tokens.shape[1]]
        if not cache.self_kv:
            cache.self_kv = [None] * len(self.layers)
        for i, layer in enumerate(self.layers):
            x, cache.self_kv[i] = layer(x, cache.self_kv[i], cache.cross[i])
        h = self.ln(x)
        b, t, d = h.shape
        # vocab-major product: with a few rows (beams) BLAS then reads the 51k x d table once,
        # where h @ W.T packed it first and took twice as long on a CPU
        return (self.embed.weight @ h.reshape(b * t, d).T).T.reshape(b, t, -1).float()


class Whisper(nn.Module):
    def __init__(self, cfg: WhisperConfig):
        super().__init__()
        self.config = cfg
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder.conv1.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.encoder.conv1.weight.device

    def new_cache(self, audio_features: torch.Tensor) -> KVCache:
        """A fresh cache whose cross-attention K/V are computed once from the encoder output."""
        return KVCache(cross=[layer.cross.kv(audio_features) for layer in self.decoder.layers])

    @staticmethod
    def reorder(cache: KVCache, index: torch.Tensor) -> None:
        """Keep (or repeat) batch rows `index` of the cache, e.g. the parents of a beam step.
        Cross-attention K/V of one row stay one row: every row shares them."""
        if cache.cross and cache.cross[0][0].shape[0] > 1:
            cache.cross = [(k[index], v[index]) for k, v in cache.cross]
        cache.self_kv = [
            None if kv is None else (kv[0][index], kv[1][index]) for kv in cache.self_kv
        ]
