"""The fused attention prologue (per-head norm, rope, paged KV write): the reference against the
engine's step-by-step path, and the triton kernel against the reference.

The kernel runs on CUDA (marked `gpu`) or under TRITON_INTERPRET=1 with CPU tensors (never in
CI). Tolerance: float32 math in the same order up to the norm's sum (1e-5 relative); the cache
stores compare after the same cast (one unit of the half type's mantissa).
"""

import pytest
import torch
import torch.nn.functional as F

from localllm.engine.layers.rope import RopeConfig, Rotary
from localllm.kernels.attention import write_paged
from localllm.kernels.fused.heads import HeadLayout, HeadNorms
from localllm.kernels.fused.rope_qkv import rope_qkv_write
from tests.triton_env import DEVICE, needs_triton

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def _case(t, lay: HeadLayout, norms: bool, dtype: torch.dtype, seed: int):
    """A fused projection y [T, (q + 2 kv) heads], cos/sin of random positions, empty caches
    (NaN-filled, so a missed store shows) and a shuffled slot per token."""
    g = torch.Generator().manual_seed(seed)
    hd = lay.head_dim
    y = torch.randn(t, (lay.n_q + 2 * lay.n_kv) * hd, generator=g) * 2
    pos = torch.randint(0, 4000, (t,), generator=g)
    rot = Rotary(RopeConfig(lay.rot_dims, 10000.0, neox=lay.neox))
    cos, sin = rot.cos_sin(pos)
    blocks, bs = 4, 8
    kc = torch.full((blocks, bs, lay.n_kv, hd), float("nan")).to(dtype)
    vc = kc.clone()
    slots = torch.randperm(blocks * bs, generator=g)[:t]
    hn = None
    if norms:
        hn = HeadNorms(torch.rand(hd, generator=g) + 0.5, torch.rand(hd, generator=g) + 0.5, 1e-6)
    return y, cos, sin, kc, vc, slots, hn, rot


def _split(y, lay):
    hd = lay.head_dim
    return y.split([lay.n_q * hd, lay.n_kv * hd, lay.n_kv * hd], dim=1)


LAYOUTS = [
    HeadLayout(8, 2, 64, 64, True),
    HeadLayout(8, 2, 64, 64, False),
    HeadLayout(4, 4, 96, 32, True),  # partial rotary: 32 of 96 dims rotate
    HeadLayout(6, 3, 80, 48, False),
]


@pytest.mark.parametrize("lay", LAYOUTS, ids=str)
@pytest.mark.parametrize("norms", [False, True])
def test_reference_equals_the_step_by_step_path(lay, norms):
    y, cos, sin, kc, vc, slots, hn, rot = _case(5, lay, norms, torch.float32, 1)
    q, k, v = _split(y, lay)
    got_q = rope_qkv_write(q, k, v, cos, sin, lay, kc, vc, slots, hn)
    hd = lay.head_dim
    q3, k3 = q.reshape(5, lay.n_q, hd), k.reshape(5, lay.n_kv, hd)
    if norms:
        q3, k3 = F.rms_norm(q3, (hd,), hn.q, hn.eps), F.rms_norm(k3, (hd,), hn.k, hn.eps)
    want_q, want_k = rot.apply(q3, cos, sin), rot.apply(k3, cos, sin)
    kw, vw = torch.full_like(kc, float("nan")), torch.full_like(vc, float("nan"))
    write_paged(kw, want_k, slots)
    write_paged(vw, v.reshape(5, lay.n_kv, hd), slots)
    torch.testing.assert_close(got_q, want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kc, kw, rtol=1e-6, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(vc, vw, rtol=0, atol=0, equal_nan=True)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("lay", LAYOUTS, ids=str)
@pytest.mark.parametrize("norms", [False, True])
@pytest.mark.parametrize("cache", sorted(DTYPES))
@pytest.mark.parametrize("t", [1, 5])
def test_triton_kernel_matches_reference(lay, norms, cache, t):
    from localllm.kernels.fused.triton_rope import rope_qkv_write_cuda

    dtype = DTYPES[cache]
    y, cos, sin, kc, vc, slots, hn, _ = _case(t, lay, norms, dtype, 2)
    q, k, v = _split(y, lay)
    want_q = rope_qkv_write(q, k, v, cos, sin, lay, kc, vc, slots, hn)

    def dev(x):
        return x.to(DEVICE)

    yd, kd, vd = (
        dev(y),
        dev(torch.full_like(kc, float("nan"))),
        dev(torch.full_like(vc, float("nan"))),
    )
    hnd = HeadNorms(dev(hn.q), dev(hn.k), hn.eps) if hn is not None else None
    qd, kkd, vvd = _split(yd, lay)  # strided views of one projection, as the engine passes them
    # slots as a column of wider rows, like the CUDA-graph inputs [B, id | position | slot | ...]
    rows = torch.stack([torch.zeros_like(slots), slots, torch.ones_like(slots)], 1)
    sd = dev(rows)[:, 1]
    got_q = rope_qkv_write_cuda(qd, kkd, vvd, dev(cos), dev(sin), lay, kd, vd, sd, hnd)
    torch.testing.assert_close(got_q.cpu(), want_q, rtol=1e-5, atol=1e-5)
    tol = 0 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(kd.cpu().float(), kc.float(), rtol=tol, atol=1e-5, equal_nan=True)
    # v is only cast; bf16 may differ by one unit of its 8-bit mantissa (the interpreter rounds
    # float32 -> bf16 by truncation, CUDA to nearest even)
    vtol = 2**-7 if dtype == torch.bfloat16 else 0
    torch.testing.assert_close(vd.cpu(), vc, rtol=vtol, atol=0, equal_nan=True)
