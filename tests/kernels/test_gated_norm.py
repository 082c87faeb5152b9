"""The Mamba-2 mixer's end in one Triton launch (`kernels/recurrent/triton_gated_norm.py`)
against its torch reference `gated_norm.skip_gate_norm_ref`: x and z read as column slices of
one wider row (as the mixer's projection leaves them), one group and several, group widths off
the blocks, float32 and bfloat16 out. Marked `gpu` (or run on CPU under TRITON_INTERPRET=1)."""

import pytest
import torch

from localllm.kernels.recurrent.gated_norm import skip_gate_norm_ref
from tests.kernels.int8_rows import assert_int8_rows_of
from tests.triton_env import DEVICE, TRITON_MARKS

pytestmark = TRITON_MARKS


@pytest.mark.parametrize(
    ("t", "h", "p", "g", "dtype"),
    [(5, 4, 16, 1, torch.float32), (3, 6, 20, 3, torch.float32), (4, 48, 64, 1, torch.bfloat16)],
)
def test_skip_gate_norm_matches_reference(t, h, p, g, dtype):
    from localllm.kernels.recurrent.triton_gated_norm import skip_gate_norm_triton

    gen = torch.Generator().manual_seed(h * p + g)
    d = h * p
    wide = torch.randn(t, 2 * d + 7, generator=gen)  # [z | x | more]: strided slices
    z, x = wide[:, :d], wide[:, d : 2 * d].reshape(t, h, p)
    y = torch.randn(t, h, p, generator=gen)
    D = torch.randn(h, generator=gen)
    w = 1 + 0.1 * torch.randn(g, d // g, generator=gen)
    want = skip_gate_norm_ref(y, x, D, z, w, 1e-5, dtype)
    dev = [v.to(DEVICE) for v in (y, wide, D, w)]
    zd, xd = dev[1][:, :d], dev[1][:, d : 2 * d].reshape(t, h, p)
    got = skip_gate_norm_triton(dev[0], xd, dev[2], zd, dev[3], 1e-5, dtype)
    assert got.dtype == dtype and got.shape == (t, d)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (got.float().cpu() - want.float()).abs().max() < tol * want.float().abs().max()


@pytest.mark.parametrize(("t", "h", "p", "g"), [(1, 48, 64, 1), (3, 8, 16, 2), (2, 6, 20, 3)])
def test_skip_gate_norm_writes_the_out_projections_int8_rows(t, h, p, g):
    """`granitehybrid.FUSED_MIXER`: with `quant` the same output, and its int8 rows exactly what
    `quantize_x8` makes of it (what ssm_out's GEMV would make itself), groups past the first at
    their offsets; none where a group is no whole number of 32s (6 x 20 / 3 = 40) or the output
    is not float32."""
    from localllm.kernels.recurrent.triton_gated_norm import skip_gate_norm_triton

    gen = torch.Generator().manual_seed(h * p + g)
    d = h * p
    wide = torch.randn(t, 2 * d + 7, generator=gen).to(DEVICE)
    z, x = wide[:, :d], wide[:, d : 2 * d].reshape(t, h, p)
    y, D = torch.randn(t, h, p, generator=gen).to(DEVICE), torch.randn(h, generator=gen).to(DEVICE)
    w = (1 + 0.1 * torch.randn(g, d // g, generator=gen)).to(DEVICE)
    plain = skip_gate_norm_triton(y, x, D, z, w, 1e-5, torch.float32)
    got, xq = skip_gate_norm_triton(y, x, D, z, w, 1e-5, torch.float32, quant=True)
    assert torch.equal(got, plain)
    if (d // g) % 32:
        assert xq is None
        return
    assert_int8_rows_of(xq, got)
    assert skip_gate_norm_triton(y, x, D, z, w, 1e-5, torch.bfloat16, quant=True)[1] is None
