"""PL-BERT, Kokoro's phoneme-level text encoder: an ALBERT (factorized embeddings, one shared
transformer layer group applied `num_hidden_layers` times, post-norm, tanh-approximated GELU).

Keys match Hugging Face's `AlbertModel` state dict (`embeddings.*`, `encoder.*`); its pooler is
not used by Kokoro and is ignored at load. Inference only, one unpadded sequence per batch row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class AlbertConfig:
    """The `plbert` block of Kokoro's config.json (ALBERT defaults where it is silent)."""

    vocab_size: int
    hidden_size: int = 768
    num_attention_heads: int = 12
    intermediate_size: int = 2048
    max_position_embeddings: int = 512
    num_hidden_layers: int = 12
    embedding_size: int = 128
    num_hidden_groups: int = 1
    inner_group_num: int = 1
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12


class AlbertEmbeddings(nn.Module):
    def __init__(self, cfg: AlbertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.embedding_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.embedding_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.embedding_size)
        self.LayerNorm = nn.LayerNorm(cfg.embedding_size, eps=cfg.layer_norm_eps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.word_embeddings(ids) + self.position_embeddings(positions)
        # every token is segment 0
        return self.LayerNorm(x + self.token_type_embeddings.weight[0])


class AlbertAttention(nn.Module):
    def __init__(self, cfg: AlbertConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.query = nn.Linear(h, h)
        self.key = nn.Linear(h, h)
        self.value = nn.Linear(h, h)
        self.dense = nn.Linear(h, h)
        self.LayerNorm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, h // self.heads).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        ctx = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, h)
        return self.LayerNorm(x + self.dense(ctx))


class AlbertLayer(nn.Module):
    def __init__(self, cfg: AlbertConfig) -> None:
        super().__init__()
        self.attention = AlbertAttention(cfg)
        self.ffn = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.ffn_output = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.full_layer_layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention(x)
        y = self.ffn_output(F.gelu(self.ffn(x), approximate="tanh"))
        return self.full_layer_layer_norm(x + y)


class AlbertLayerGroup(nn.Module):
    def __init__(self, cfg: AlbertConfig) -> None:
        super().__init__()
        self.albert_layers = nn.ModuleList(AlbertLayer(cfg) for _ in range(cfg.inner_group_num))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.albert_layers:
            x = layer(x)
        return x


class AlbertEncoder(nn.Module):
    def __init__(self, cfg: AlbertConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embedding_hidden_mapping_in = nn.Linear(cfg.embedding_size, cfg.hidden_size)
        self.albert_layer_groups = nn.ModuleList(
            AlbertLayerGroup(cfg) for _ in range(cfg.num_hidden_groups)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embedding_hidden_mapping_in(x)
        layers, groups = self.cfg.num_hidden_layers, self.cfg.num_hidden_groups
        for i in range(layers):
            # ALBERT shares weights: consecutive layers reuse one group
            x = self.albert_layer_groups[i * groups // layers](x)
        return x


class Albert(nn.Module):
    """Token ids [B, T] -> last hidden states [B, T, hidden_size]."""

    def __init__(self, cfg: AlbertConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = AlbertEmbeddings(cfg)
        self.encoder = AlbertEncoder(cfg)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.embeddings(ids))
