"""The `qwen3` GGUF architecture: Qwen3 dense models.

Qwen2's decoder (NEOX rope, SwiGLU, tied or separate output) without the Q/K/V biases and with
a per-head RMSNorm on queries and keys (`attn_q_norm`, `attn_k_norm`) applied before rope, as in
llama.cpp's qwen3 graph. Head size comes from `attention.key_length` (Qwen3-0.6B: 128 while
dim / heads = 64).
"""

from localllm.engine.layers.shared import RMSNorm
from localllm.engine.models import qwen2
from localllm.kernels.fused.heads import HeadNorms

ModelArgs = qwen2.ModelArgs


class Block(qwen2.Block):
    def __init__(self, args: ModelArgs, precise: bool):
        super().__init__(args, precise)
        self.attn_q_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.attn_k_norm = RMSNorm(args.head_dim, args.norm_eps)

    def head_norms(self) -> HeadNorms:
        return HeadNorms(self.attn_q_norm.weight, self.attn_k_norm.weight, self.attn_q_norm.eps)


class Model(qwen2.Model):
    block_cls = Block
