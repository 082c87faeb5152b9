"""The attention prologue of a decoder layer in one step: optional per-head RMSNorm of q and k
(qwen3), rotary embedding, and the write of k and v into the paged cache.

`rope_qkv_write` is the plain-torch reference (and the CPU path); on CUDA tensors it runs the
triton kernel of `triton_rope` instead: one launch per layer instead of ~6-25 eager kernels
(the rope multiply-adds, the casts to the cache dtype, the two index copies, qwen3's norms).
"""

import torch
import torch.nn.functional as F

from localllm.kernels.fused.heads import HeadLayout, HeadNorms


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lay: HeadLayout):
    """Rotate x [T, heads, head_dim] with cos/sin [T, rot_dims / 2]."""
    d = lay.rot_dims
    rot, rest = x[..., :d], x[..., d:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    if lay.neox:
        x1, x2 = rot[..., : d // 2], rot[..., d // 2 :]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((out, rest), dim=-1)


def fusable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the fused kernel serves this call: float32 rows on CUDA and a plain float cache
    (the 8-bit cache formats carry scales and keep their own encoder)."""
    plain = k_cache.dtype in (torch.float16, torch.bfloat16, torch.float32)
    return q.is_cuda and q.dtype == torch.float32 and plain


def rope_qkv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    lay: HeadLayout,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    norms: HeadNorms | None = None,
) -> torch.Tensor:
    """q [T, n_q * head_dim], k and v [T, n_kv * head_dim] (row-strided views of one projection
    are fine) -> rotated q [T, n_q, head_dim] float32; rotated k and v are stored at their slots
    of k_cache / v_cache [blocks, block_size, n_kv, head_dim]."""
    if fusable(q, k_cache):
        from localllm.kernels.fused.triton_rope import rope_qkv_write_cuda

        return rope_qkv_write_cuda(q, k, v, cos, sin, lay, k_cache, v_cache, slot_mapping, norms)
    hd = lay.head_dim
    q3, k3 = q.reshape(-1, lay.n_q, hd), k.reshape(-1, lay.n_kv, hd)
    if norms is not None:
        q3 = F.rms_norm(q3, (hd,), norms.q, norms.eps)
        k3 = F.rms_norm(k3, (hd,), norms.k, norms.eps)
    q3, k3 = rope_reference(q3, cos, sin, lay), rope_reference(k3, cos, sin, lay)
    for cache, val in ((k_cache, k3), (v_cache, v.reshape(-1, lay.n_kv, hd))):
        cache.flatten(0, 1).index_copy_(0, slot_mapping, val.to(cache.dtype))
    return q3
