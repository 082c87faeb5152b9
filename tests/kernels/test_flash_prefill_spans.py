"""Flash prefill with bidirectional spans (Gemma 3's image tokens) against `paged.chunk_dense`
in float64 (itself checked against the token-type reference in test_paged_spans.py): spans that
cross the kernel's 32-row tiles, a span that starts before the chunk (a prefix-cache hit inside
an image), two spans, a sliding window shorter than a span, f16 and f32 keys.

Runs on CUDA (marked `gpu`) or under TRITON_INTERPRET=1 (CPU tensors; never in CI, which has no
triton). Tolerances as test_flash_prefill.py: 2e-5 with float32 keys, 5e-3 with f16 keys.
"""

import pytest
import torch

from localllm.kernels.attention.paged import _chunk, chunk_dense
from tests.triton_env import DEVICE, TRITON_MARKS

pytestmark = TRITON_MARKS


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("t", "m", "heads", "kvh", "window", "spans"),
    [
        (100, 100, 8, 2, None, [(20, 76)]),  # an image across tiles, text on both sides
        (40, 70, 4, 4, None, [(18, 50)]),  # the chunk starts inside the image (key 30)
        (90, 90, 4, 2, None, [(5, 21), (40, 88)]),  # two images
        (80, 80, 4, 2, 8, [(10, 60)]),  # a window shorter than the image
    ],
)
def test_flash_prefill_spans_match_the_dense_path(t, m, heads, kvh, window, spans, dtype):
    from localllm.kernels.attention.triton_prefill import flash_prefill

    d = 32
    gen = torch.Generator().manual_seed(t + m)
    keys = torch.randn(m, kvh, d, generator=gen).to(dtype)
    vals = torch.randn(m, kvh, d, generator=gen).to(dtype)
    q = torch.randn(t, heads, d, generator=gen)
    q0 = m - t
    args = (q.double(), keys.double(), vals.double(), q0, d**-0.5, window, None, None)
    want = chunk_dense(*args, spans)
    got = flash_prefill(q.to(DEVICE), keys.to(DEVICE), vals.to(DEVICE), q0, d**-0.5, window,
                        spans=spans)  # fmt: skip
    tol = 2e-5 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(got.cpu().double(), want, rtol=0, atol=tol)
    causal = chunk_dense(*args)  # the spans change the answer: ignoring them could not pass
    assert (causal - want).abs().max() > 100 * tol


def test_the_chunk_path_passes_spans_to_the_kernel():
    """`paged._chunk` on the kernel's device: the same answer as the dense path with spans."""
    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(60, 2, 32, generator=gen)
    vals = torch.randn(60, 2, 32, generator=gen)
    q = torch.randn(60, 4, 32, generator=gen)
    want = chunk_dense(q.double(), keys.double(), vals.double(), 0, 0.2, None, None, None,
                       [(10, 50)])  # fmt: skip
    if DEVICE == "cuda":
        got = _chunk(q.cuda(), keys.cuda(), vals.cuda(), 0, 0.2, None, None, None, [(10, 50)])
    else:  # the interpreter: call the kernel as _chunk does on CUDA
        from localllm.kernels.attention.triton_prefill import flash_prefill

        got = flash_prefill(q, keys, vals, 0, 0.2, spans=[(10, 50)])
    torch.testing.assert_close(got.cpu().double(), want, rtol=0, atol=2e-5)
