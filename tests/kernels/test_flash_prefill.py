"""Flash attention for prompt chunks (`triton_prefill.flash_prefill`) against `paged._chunk`'s
dense torch path in float64: GQA groups, earlier context (queries not at key 0), sliding window,
soft-cap, attention sinks, f16/f32 keys, strided views of a cache, tiles cut mid-sequence.

Runs on CUDA (marked `gpu`) or under TRITON_INTERPRET=1 (CPU tensors; never in CI, which has no
triton). Tolerance: float32 keys, products in three tf32 passes and the online softmax in
another order, 2e-5 absolute on O(1) outputs; f16 keys, one tf32 pass (q and the softmax weights
rounded to 10 bits), 5e-3 (2e-3 measured at 512 and 2,048 tokens on the H200).
"""

import pytest
import torch

from localllm.kernels.attention.paged import _chunk
from tests.triton_env import CUDA, DEVICE, TRITON_MARKS

pytestmark = TRITON_MARKS


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("t", "m", "heads", "kvh", "d", "window", "softcap", "sinks"),
    [
        (100, 100, 8, 2, 64, None, None, False),  # a fresh prompt, tiles cut mid-sequence
        (37, 170, 4, 4, 32, None, None, False),  # a chunk after 133 keys of context
        (130, 130, 6, 2, 64, 48, None, False),  # sliding window
        (70, 90, 4, 2, 64, None, 30.0, True),  # soft-cap and sinks
        (64, 300, 4, 1, 128, 100, 50.0, True),  # everything at once, window past the tile
    ],
)
def test_flash_prefill_matches_reference(t, m, heads, kvh, d, window, softcap, sinks, dtype):
    from localllm.kernels.attention.triton_prefill import flash_prefill, supports

    gen = torch.Generator().manual_seed(t * m + heads)
    # keys/values as views of a cache's rows [m, KV, D] with a row stride past KV * D
    cache_k = torch.randn(m, kvh + 1, d, generator=gen).to(dtype)
    cache_v = torch.randn(m, kvh + 1, d, generator=gen).to(dtype)
    keys, vals = cache_k[:, 1:], cache_v[:, 1:]
    q = torch.randn(t, heads, d, generator=gen)
    sk = torch.randn(heads, generator=gen) if sinks else None
    q0 = m - t
    want = _chunk(
        q.double(), keys.double(), vals.double(), q0, d**-0.5, window, softcap,
        None if sk is None else sk.double(),
    )  # fmt: skip
    kd, vd = keys.to(DEVICE), vals.to(DEVICE)
    assert supports(q.to(DEVICE), kd, vd) == CUDA
    got = flash_prefill(
        q.to(DEVICE), kd, vd, q0, d**-0.5, window, softcap, None if sk is None else sk.to(DEVICE)
    )
    assert got.shape == (t, heads, d) and got.dtype == torch.float32
    tol = 2e-5 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(got.cpu().double(), want, rtol=0, atol=tol)


def test_head_dims_that_are_not_tiles_stay_on_the_reference():
    from localllm.kernels.attention.triton_prefill import supports

    q = torch.zeros(4, 2, 80, device=DEVICE)
    k = torch.zeros(4, 1, 80, device=DEVICE)
    assert not supports(q, k, k)
    assert not supports(q[..., :8].contiguous(), k[..., :8], k[..., :8])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("t", "start", "pad", "heads", "kvh", "d", "window", "softcap", "sinks"),
    [
        (40, 0, 8, 8, 2, 64, None, None, False),  # a prompt padded to 48 rows
        (37, 133, 11, 4, 4, 32, None, None, False),  # a chunk after 133 keys of context
        (50, 30, 14, 6, 2, 64, 20, None, False),  # sliding window, padded
        (70, 20, 26, 4, 2, 64, None, 30.0, True),  # soft-cap and sinks
        (64, 236, 0, 4, 1, 128, 100, 50.0, True),  # everything at once, window past the tile
    ],
)
def test_paged_prefill_reads_blocks_through_the_table(
    t, start, pad, heads, kvh, d, window, softcap, sinks, dtype
):
    """`flash_prefill_paged`: the context through a shuffled block table and device lengths,
    padding rows past the chunk; real rows as the reference's, and bit-equal to `flash_prefill`
    over the gathered keys where both walk the same key tiles (no window)."""
    from localllm.kernels.attention.triton_prefill import flash_prefill, flash_prefill_paged

    bs, m = 16, start + t
    gen = torch.Generator().manual_seed(t * m + heads)
    nb = -(-m // bs)
    table = torch.randperm(nb + 3, generator=gen)[:nb]  # some blocks belong to no one
    k_cache = torch.randn(nb + 3, bs, kvh, d, generator=gen).to(dtype)
    v_cache = torch.randn(nb + 3, bs, kvh, d, generator=gen).to(dtype)
    keys = k_cache[table].flatten(0, 1)[:m]
    vals = v_cache[table].flatten(0, 1)[:m]
    q = torch.randn(t + pad, heads, d, generator=gen)
    sk = torch.randn(heads, generator=gen) if sinks else None
    want = _chunk(
        q[:t].double(), keys.double(), vals.double(), start, d**-0.5, window, softcap,
        None if sk is None else sk.double(),
    )  # fmt: skip
    wide = torch.cat([table, torch.zeros(5, dtype=torch.long)])  # a table padded past its end
    dev = {"device": DEVICE}
    got = flash_prefill_paged(
        q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), wide.to(DEVICE),
        torch.tensor([start, m], **dev), d**-0.5, window, softcap,
        None if sk is None else sk.to(DEVICE),
    )  # fmt: skip
    assert got.shape == (t + pad, heads, d) and got.dtype == torch.float32
    tol = 2e-5 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(got[:t].cpu().double(), want, rtol=0, atol=tol)
    if window is None:
        flat = flash_prefill(
            q[:t].to(DEVICE), keys.to(DEVICE), vals.to(DEVICE), start, d**-0.5, None, softcap,
            None if sk is None else sk.to(DEVICE),
        )  # fmt: skip
        assert torch.equal(got[:t], flat)
