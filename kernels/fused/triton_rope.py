"""Triton kernel of `rope_qkv`: per-head norm, rope and the paged KV write in one launch (CUDA;
or CPU tensors under TRITON_INTERPRET=1 in tests).

One program per (token, head) over the n_q + n_kv rotated heads; the program of kv head j also
copies v head j into the cache. Float32 math like the reference; the cache store casts.
"""

import torch
import triton
import triton.language as tl

from localllm.kernels import pdl
from localllm.kernels.fused.heads import HeadLayout, HeadNorms


@triton.jit
def _rotate_head(
    src,
    dst,
    w_ptr,
    cos_ptr,
    sin_ptr,
    eps,
    HD: tl.constexpr,
    ROT: tl.constexpr,
    NEOX: tl.constexpr,
    NORM: tl.constexpr,
    BP: tl.constexpr,
    BD: tl.constexpr,
):
    """Load one head at `src`, norm it (NORM), rotate its first ROT dims, store it at `dst`."""
    half: tl.constexpr = ROT // 2
    i = tl.arange(0, BP)
    pm = i < half
    if NEOX:
        ia, ib = i, i + half
    else:
        ia, ib = 2 * i, 2 * i + 1
    a = tl.load(src + ia, mask=pm, other=0.0)
    b = tl.load(src + ib, mask=pm, other=0.0)
    j = tl.arange(0, BD)
    jm = (j >= ROT) & (j < HD)  # dims past the rotated ones pass through
    r = tl.load(src + j, mask=jm, other=0.0)
    if NORM:
        ss = tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0) + tl.sum(r * r, axis=0)
        inv = 1.0 / tl.sqrt(ss / HD + eps)
        a = a * inv * tl.load(w_ptr + ia, mask=pm, other=0.0)
        b = b * inv * tl.load(w_ptr + ib, mask=pm, other=0.0)
        r = r * inv * tl.load(w_ptr + j, mask=jm, other=0.0)
    c = tl.load(cos_ptr + i, mask=pm, other=0.0)
    s = tl.load(sin_ptr + i, mask=pm, other=0.0)
    ty = dst.dtype.element_ty
    tl.store(dst + ia, (a * c - b * s).to(ty), mask=pm)
    tl.store(dst + ib, (b * c + a * s).to(ty), mask=pm)
    tl.store(dst + j, r.to(ty), mask=jm)


@triton.jit
def _rope_qkv(
    q_ptr,
    k_ptr,
    v_ptr,
    sq,
    sk,
    sv,
    cos_ptr,
    sin_ptr,
    qn_ptr,
    kn_ptr,
    eps,
    out_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    s_slot,
    NQ: tl.constexpr,
    NKV: tl.constexpr,
    HD: tl.constexpr,
    ROT: tl.constexpr,
    NEOX: tl.constexpr,
    NORM: tl.constexpr,
    BP: tl.constexpr,
    BD: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.gdc_begin(PDL)
    pdl.gdc_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cs = cos_ptr + t * (ROT // 2)
    sn = sin_ptr + t * (ROT // 2)
    # names differ between the branches: triton needs one type per name across an if
    if h < NQ:
        q_dst = out_ptr + (t * NQ + h) * HD
        _rotate_head(
            q_ptr + t * sq + h * HD, q_dst, qn_ptr, cs, sn, eps, HD, ROT, NEOX, NORM, BP, BD
        )
    else:
        j = h - NQ
        slot = tl.load(slot_ptr + t * s_slot)
        k_dst = kc_ptr + (slot * NKV + j) * HD
        _rotate_head(
            k_ptr + t * sk + j * HD, k_dst, kn_ptr, cs, sn, eps, HD, ROT, NEOX, NORM, BP, BD
        )
        d = tl.arange(0, BD)
        dm = d < HD
        val = tl.load(v_ptr + t * sv + j * HD + d, mask=dm, other=0.0)
        v_dst = vc_ptr + (slot * NKV + j) * HD
        tl.store(v_dst + d, val.to(v_dst.dtype.element_ty), mask=dm)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """A 2-D view whose rows may be strided but whose columns are contiguous."""
    x2 = x.reshape(x.shape[0], -1)
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def rope_qkv_write_cuda(
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
    q2, k2, v2 = _rows(q), _rows(k), _rows(v)
    t = q2.shape[0]
    out = torch.empty(t, lay.n_q, lay.head_dim, dtype=torch.float32, device=q.device)
    if t == 0:
        return out
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    qn = norms.q if norms is not None else cos
    kn = norms.k if norms is not None else cos
    eps = norms.eps if norms is not None else 0.0
    bp = triton.next_power_of_2(max(lay.rot_dims // 2, 1))
    bd = triton.next_power_of_2(lay.head_dim)
    grid = (t, lay.n_q + lay.n_kv)
    _rope_qkv[grid](
        q2,
        k2,
        v2,
        q2.stride(0),
        k2.stride(0),
        v2.stride(0),
        cos,
        sin,
        qn,
        kn,
        eps,
        out,
        k_cache,
        v_cache,
        slot_mapping,
        slot_mapping.stride(0),  # a column of the CUDA-graph input rows: strided
        NQ=lay.n_q,
        NKV=lay.n_kv,
        HD=lay.head_dim,
        ROT=lay.rot_dims,
        NEOX=lay.neox,
        NORM=norms is not None,
        BP=bp,
        BD=bd,
        num_warps=1,
        **pdl.launch_options(pdl.enabled(q)),
    )
    return out
