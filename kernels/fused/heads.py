"""How one attention layer's heads are laid out and normed: what the rope kernels (the torch
reference in `rope_qkv` and the triton kernel in `triton_rope`) both take."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class HeadLayout:
    """Heads of one attention layer and how rope rotates them."""

    n_q: int
    n_kv: int
    head_dim: int
    rot_dims: int  # leading dims that rotate (partial rotary when < head_dim)
    neox: bool  # True: pairs (i, i + rot/2); False: adjacent pairs (2i, 2i + 1)


@dataclass(frozen=True, slots=True)
class HeadNorms:
    """Per-head RMSNorm weights [head_dim] applied to q and k before rope (qwen3, gemma3)."""

    q: torch.Tensor
    k: torch.Tensor
    eps: float
