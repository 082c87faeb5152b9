"""The `bert` and `nomic-bert` GGUF architectures: BERT-style encoders for embeddings.

`bert` (all-MiniLM, bge, e5, ...), post-norm: word + token-type + absolute position embeddings ->
LayerNorm; per block bidirectional attention -> residual -> LayerNorm, GELU MLP -> residual ->
LayerNorm. `nomic-bert` (nomic-embed-text) has no position table but NEOX rope on q/k, one fused
`attn_qkv` and a SwiGLU MLP. Modules are named after the GGUF tensors of llama.cpp's converter.
An encoder produces hidden states only: it has no output head, keeps no KV cache and cannot
generate (`generates = False`). A cross-encoder (reranker: BertForSequenceClassification and
RoBERTa-style heads, `pooling_type` rank) also carries llama.cpp's classification head, which
`RankHead` runs on the first token's state.
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from localllm.engine.layers.linear import FusedLinear, QuantLinear, dense
from localllm.engine.layers.rope import RopeConfig, Rotary
from localllm.engine.layers.shared import QuantEmbedding
from localllm.engine.models.common import arch_key
from localllm.engine.models.hparams import HyperparameterError, read
from localllm.offload import QuantWeight

TOKEN_TYPES = "tokenizer.ggml.token_type_count"


@dataclass(frozen=True)
class ModelArgs:
    arch: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    head_dim: int
    hidden_dim: int
    norm_eps: float
    context_length: int
    n_token_types: int
    pooling_type: int | None  # llama.cpp's enum (0 none, 1 mean, 2 cls, 3 last, 4 rank)
    rope_base: float
    nomic: bool  # nomic-bert: rope, fused qkv, SwiGLU, no position table

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], vocab_size: int) -> "ModelArgs":
        k = arch_key(meta)
        n_heads = k("attention.head_count")
        dim = k("embedding_length")
        return cls(
            arch=meta["general.architecture"],
            vocab_size=vocab_size,
            dim=dim,
            n_layers=k("block_count"),
            n_heads=n_heads,
            head_dim=dim // n_heads,
            hidden_dim=k("feed_forward_length"),
            norm_eps=k("attention.layer_norm_epsilon", 1e-12),
            context_length=k("context_length", 512),
            n_token_types=read(TOKEN_TYPES, "token_type_count", meta.get(TOKEN_TYPES, 2)),
            pooling_type=k("pooling_type", None),
            rope_base=k("rope.freq_base", 1000.0),
            nomic=meta["general.architecture"] == "nomic-bert",
        )

    def check(self) -> None:
        """The heads split the width exactly (q, k and v are dim x dim)."""
        if self.dim % self.n_heads:
            raise HyperparameterError(
                f"attention.head_count is {self.n_heads}, expected a divisor of "
                f"embedding_length {self.dim}"
            )


class LayerNorm(nn.Module):
    """LayerNorm with GGUF `weight` and `bias` tensors."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = torch.ones(dim)
        self.bias = torch.zeros(dim)
        self.loaded = False

    def load_tensor(self, suffix: str, w: QuantWeight) -> None:
        if suffix not in ("weight", "bias") or tuple(w.shape) != tuple(self.weight.shape):
            raise ValueError(f"expected norm {suffix} of {tuple(self.weight.shape)}, got {w.shape}")
        setattr(self, suffix, dense(w))
        self.loaded = self.loaded or suffix == "weight"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, precise: bool):
        super().__init__()
        d = args.dim
        self.args = args
        if args.nomic:
            self.attn_qkv = QuantLinear(d, 3 * d, precise)
            self.ffn_gate = QuantLinear(d, args.hidden_dim, precise)
        else:
            self.attn_q = QuantLinear(d, d, precise)
            self.attn_k = QuantLinear(d, d, precise)
            self.attn_v = QuantLinear(d, d, precise)
        self.attn_output = QuantLinear(d, d, precise)
        self.attn_output_norm = LayerNorm(d, args.norm_eps)
        self.ffn_up = QuantLinear(d, args.hidden_dim, precise)
        self.ffn_down = QuantLinear(args.hidden_dim, d, precise)
        self.layer_output_norm = LayerNorm(d, args.norm_eps)
        self.qkv: FusedLinear | None = None

    def fuse(self) -> None:
        if self.args.nomic:
            return  # the file already fuses q, k and v
        parts = [self.attn_q, self.attn_k, self.attn_v]
        if FusedLinear.fusable(parts):
            self.qkv = FusedLinear(parts)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, rope: tuple | None) -> torch.Tensor:
        """x [B, L, dim]; mask [B, 1, 1, L] True where a key is a real token; rope: (rotary,
        cos, sin) over the B * L flat positions, or None."""
        b, n, d = x.shape
        h, hd = self.args.n_heads, self.args.head_dim
        if self.args.nomic:
            q, k, v = self.attn_qkv(x).split(d, dim=-1)
        elif self.qkv is not None:
            q, k, v = self.qkv(x)
        else:
            q, k, v = self.attn_q(x), self.attn_k(x), self.attn_v(x)
        if rope is not None:
            rotary, cos, sin = rope
            q, k = (rotary.apply(t.reshape(b * n, h, hd), cos, sin) for t in (q, k))
        q, k, v = (t.reshape(b, n, h, hd).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=hd**-0.5)
        x = self.attn_output_norm(x + self.attn_output(o.transpose(1, 2).reshape(b, n, d)))
        if self.args.nomic:
            y = self.ffn_down(F.silu(self.ffn_gate(x)) * self.ffn_up(x))
        else:  # BERT's "gelu" is the exact erf form (transformers' ACT2FN["gelu"])
            y = self.ffn_down(F.gelu(self.ffn_up(x)))
        return self.layer_output_norm(x + y)


class RankHead(nn.Module):
    """llama.cpp's rank pooling head: `cls` (dense, then tanh) and `cls.output` (dense), either
    one optional, over the first token's final state; one score per label.

    llama.cpp's converter writes RoBERTa's `classifier.dense` / `classifier.out_proj` as `cls` /
    `cls.output`, and BERT's `classifier` as `cls.output` alone (it drops `bert.pooler`, so such a
    file scores `classifier(h[CLS])`, not transformers' `classifier(tanh(pooler(h[CLS])))`).
    """

    def __init__(self, dense: tuple | None, out: tuple | None):
        super().__init__()
        self.dense, self.out = dense, out  # (weight [m, n], bias [m] or None)

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], dim: int) -> "RankHead | None":
        """The head from the file's `cls.*` tensors (dense float), or None when it has none."""
        dense = _dense_pair(t, "cls", dim, flat=False)
        width = dim if dense is None else dense[0].shape[0]
        out = _dense_pair(t, "cls.output", width, flat=True)
        return None if dense is None and out is None else cls(dense, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, dim] -> scores [B, labels]."""
        for layer, act in ((self.dense, torch.tanh), (self.out, None)):
            if layer is not None:
                w, b = layer
                x = F.linear(x, w.to(x.dtype), None if b is None else b.to(x.dtype))
                x = act(x) if act is not None else x
        return x


def _dense_pair(t: dict, name: str, n_in: int, flat: bool) -> tuple | None:
    """(weight [m, n_in], bias [m] or None) of `name`, checked. `flat`: a one-label weight may
    come as [n_in] (a converter that squeezes it) and its bias as one value."""
    w, b = t.get(f"{name}.weight"), t.get(f"{name}.bias")
    if w is None:
        if b is not None:
            raise ValueError(f"{name}.bias without {name}.weight")
        return None
    if w.dim() == 1 and flat:
        w = w.reshape(1, -1)
    if w.dim() != 2 or w.shape[1] != n_in:
        raise ValueError(f"{name}.weight must be [labels, {n_in}], got {tuple(w.shape)}")
    if b is not None:
        b = b.reshape(-1)
        if b.shape[0] != w.shape[0]:
            raise ValueError(f"{name}.bias has {b.shape[0]} values for {w.shape[0]} outputs")
    return w.float(), None if b is None else b.float()


class Model(nn.Module):
    generates = False  # encoder-only: hidden states for embeddings, no next-token head
    # A reranker's classification head; read into `rank_head` by finish_load.
    optional_tensors = (
        "token_types.weight",
        "cls.weight",
        "cls.bias",
        "cls.output.weight",
        "cls.output.bias",
    )

    def __init__(self, args: ModelArgs, precise: bool = False):
        super().__init__()
        self.args = args
        self.token_embd = QuantEmbedding(args.vocab_size, args.dim)
        self.token_types = QuantEmbedding(args.n_token_types, args.dim)
        if not args.nomic:
            self.position_embd = QuantEmbedding(args.context_length, args.dim)
        self.token_embd_norm = LayerNorm(args.dim, args.norm_eps)
        self.blk = nn.ModuleList(Block(args, precise) for _ in range(args.n_layers))
        self.rotary: Rotary | None = None
        self.rank_head: RankHead | None = None

    def kv_shape(self) -> tuple[int, int, int]:
        return self.args.n_layers, self.args.n_heads, self.args.head_dim

    def kv_value_dim(self) -> None:
        return None

    def finish_load(self, extra: dict[str, torch.Tensor]) -> None:
        if self.args.nomic:
            a = self.args
            self.rotary = Rotary(RopeConfig(a.head_dim, a.rope_base, neox=True))
        for blk in self.blk:
            blk.fuse()
        self.rank_head = RankHead.from_tensors(extra, self.args.dim)

    def encode(
        self, ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Last hidden states [B, L, dim] of padded ids [B, L] (mask [B, L]: True for tokens).

        Every sequence starts at position 0. `types` [B, L]: token types (a pair's second segment
        is 1), used where the model has more than one; None: type 0 throughout (one text).
        """
        b, n = ids.shape
        if n > self.args.context_length:
            raise ValueError(f"{n} tokens exceed the context of {self.args.context_length}")
        x = self.token_embd(ids.reshape(-1)).reshape(b, n, -1)
        pos = torch.arange(n, device=ids.device)
        rope = None
        if self.rotary is not None:
            cos, sin = self.rotary.cos_sin(pos.repeat(b))
            rope = (self.rotary, cos, sin)
        else:
            x = x + self.position_embd(pos)
        if self.token_types.loaded:
            if types is not None and self.args.n_token_types > 1:
                x = x + self.token_types(types.reshape(-1)).reshape(b, n, -1)
            else:
                x = x + self.token_types(torch.zeros(1, dtype=torch.long, device=ids.device))
        x = self.token_embd_norm(x)
        attn_mask = mask[:, None, None, :]
        for blk in self.blk:
            x = blk(x, attn_mask, rope)
        return x

    def forward(self, *args: Any) -> torch.Tensor:
        raise ValueError("a BERT encoder has no decoder forward: use encode() for embeddings")
