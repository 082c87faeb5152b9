"""The `qwen3` GGUF architecture: Qwen3 dense models.

Qwen2's decoder (NEOX rope, SwiGLU, tied or separate output) without the Q/K/V biases and with
a per-head RMSNorm on queries and keys (`attn_q_norm`, `attn_k_norm`) applied before rope, as in
llama.cpp's qwen3 graph. Head size comes from `attention.key_length` (Qwen3-0.6B: 128 while
dim / heads = 64).
"""

import torch

from localllm.engine.layers import RMSNorm
from localllm.engine.models import qwen2

ModelArgs = qwen2.ModelArgs


class Block(qwen2.Block):
    def __init__(self, args: ModelArgs, precise: bool):
        super().__init__(args, precise)
        self.attn_q_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.attn_k_norm = RMSNorm(args.head_dim, args.norm_eps)

    def qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().qkv(h)
        return self.attn_q_norm(q), self.attn_k_norm(k), v


class Model(qwen2.Model):
    block_cls = Block
