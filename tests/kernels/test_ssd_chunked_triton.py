"""The chunked Mamba-2 prompt scan (`kernels/recurrent/triton_ssd_chunked.py`) against the
token-by-token torch reference `ssd.ssd_scan` per sequence: outputs and final states of a flat
batch whose sequences end inside, on and past chunk borders, from nonzero states, grouped heads,
head and state sizes off the blocks, rows read through strided views (a split of the mixer's
projection, as the model passes them). Marked `gpu` (or run on CPU under TRITON_INTERPRET=1)."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from localllm.kernels.recurrent.ssd import ssd_scan
from tests.triton_env import DEVICE, TRITON_MARKS

pytestmark = TRITON_MARKS


def _case(lens, h, p, g, n, seed):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    x = torch.randn(t, h, p, generator=gen)
    b, c = torch.randn(t, g, n, generator=gen), torch.randn(t, g, n, generator=gen)
    dt = F.softplus(torch.randn(t, h, generator=gen) - 1)
    a = -torch.rand(h, generator=gen) * 2 - 0.05
    state = 0.5 * torch.randn(len(lens), h, p, n, generator=gen)
    return x, dt, a, b, c, state


def _on_device(x, b, c, strided: bool):
    """x, B and C on the device; `strided`: as column slices of one wider row there, like the
    mixer's split of its projection (sliced on the device: `.to` would compact a view)."""
    if not strided:
        return x.to(DEVICE), b.to(DEVICE), c.to(DEVICE)
    t, (h, p), (g, n) = x.shape[0], x.shape[1:], b.shape[1:]
    wide = torch.cat([x.reshape(t, -1), b.reshape(t, -1), c.reshape(t, -1), x[:, 0]], 1)
    wide = wide.to(DEVICE)
    return (wide[:, : h * p].reshape(t, h, p), wide[:, h * p : h * p + g * n].reshape(t, g, n),
            wide[:, h * p + g * n : h * p + 2 * g * n].reshape(t, g, n))  # fmt: skip


@pytest.mark.parametrize(
    ("lens", "h", "p", "g", "n", "chunk", "strided"),
    [
        ([5, 1, 40, 2, 17], 6, 20, 3, 12, 16, False),  # shorter and longer than a chunk
        ([16, 33, 1], 4, 16, 2, 8, 16, True),  # ends on a border, one past it
        ([130, 3], 4, 64, 1, 128, 64, True),  # Granite-4.0-H's head and state sizes
    ],
)
def test_chunked_scan_matches_token_by_token(lens, h, p, g, n, chunk, strided):
    from localllm.kernels.recurrent.triton_ssd_chunked import chunk_table, ssd_chunked_triton

    x, dt, a, b, c, state = _case(lens, h, p, g, n, sum(lens) + h)
    qs = [0, *itertools.accumulate(lens)]
    ref = state.clone()
    want = torch.cat([ssd_scan(x[s:e], dt[s:e], a, b[s:e], c[s:e], ref[i])
                      for i, (s, e) in enumerate(itertools.pairwise(qs))])  # fmt: skip
    rows, first = chunk_table(qs, chunk)
    assert len(first) == len(lens) + 1 and len(rows) == 2 * first[-1]
    chunks = torch.tensor(rows, dtype=torch.int32).view(-1, 2).to(DEVICE)
    got_state = state.clone().to(DEVICE)
    xd, bd, cd = _on_device(x, b, c, strided)
    assert xd.is_contiguous() != strided
    firsts = torch.tensor(first, dtype=torch.int32).to(DEVICE)
    got = ssd_chunked_triton(xd, dt.to(DEVICE), a.to(DEVICE), bd, cd, got_state, chunks, firsts,
                             chunk)  # fmt: skip
    scale = want.abs().max()
    assert (got.cpu() - want).abs().max() < 2e-5 * scale
    assert (got_state.cpu() - ref).abs().max() < 2e-5 * ref.abs().max()


def test_chunk_table_cuts_each_sequence():
    from localllm.kernels.recurrent.triton_ssd_chunked import chunk_table

    rows, first = chunk_table([0, 3, 3 + 64, 3 + 64 + 65], 64)
    assert rows == [0, 3, 3, 67, 67, 131, 131, 132]
    assert first == [0, 1, 2, 4]
