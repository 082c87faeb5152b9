"""`LoraDelta` (stacked adapters, per-row factors) against `reference_delta` (PEFT's formula per
adapter), row by row: a plain linear, a fused linear's parts (one part untargeted) and their
stacked outputs; rows on no adapter, one, or two at other scales; CPU skip and always-on modes,
and a step longer than the row buffer (grown on CPU, refused where graphs read it)."""

import pytest
import torch

from localllm.engine.lora.delta import LoraContext, LoraDelta, reference_delta

IN = 24
RANKS = (4, 8)


def _pairs(out: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(r, IN, generator=g), torch.randn(out, r, generator=g)) for r in RANKS]


def _part(pairs, targets=(0, 1)):
    """(A_all, B_all, column slots) as attach_adapters stacks them (scaling folded into B)."""
    a = torch.cat([pairs[s][0] for s in targets])
    b = torch.cat([pairs[s][1] * 0.5 for s in targets], dim=1)
    return a, b, [s for s in targets for _ in range(pairs[s][0].shape[0])]


ROWS = [((), 2), (((0, 1.0),), 3), (((1, 2.0),), 1), (((0, 0.5), (1, -1.0)), 2)]


def _want(x, y, pairs, targets=(0, 1)):
    out, r = y.clone(), 0
    for lora, n in ROWS:
        for slot, factor in lora:
            if slot in targets:
                a, b = pairs[slot]
                out[r : r + n] += factor * reference_delta(x[r : r + n], a, b, 0.5)
        r += n
    return out


@pytest.mark.parametrize("always", [False, True])
@pytest.mark.parametrize("rows", [2048, 4096])
def test_delta_matches_the_reference_per_row(always, rows):
    ctx = LoraContext(2, torch.device("cpu"))
    ctx.always = always
    g = torch.Generator().manual_seed(0)
    n = sum(k for _, k in ROWS)
    x = torch.randn(n, IN, generator=g)
    single, q, v = _pairs(16, 1), _pairs(12, 2), _pairs(20, 3)
    plain = LoraDelta(ctx, [_part(single)])
    empty = (torch.zeros(0, IN), torch.zeros(8, 0), [])
    fused = LoraDelta(ctx, [_part(q), empty, _part(v, (1,))])
    long = [*ROWS[:-1], (ROWS[-1][0], rows)]
    if rows != 2048 and always:  # CUDA's buffer is fixed (graphs read it): a clear error
        with pytest.raises(ValueError, match="exceeds the LoRA row buffer"):
            ctx.set_rows(long)
        return
    ctx.set_rows(ROWS if rows == 2048 else long)
    if rows != 2048:  # a step longer than the buffer grows it (CPU); the first rows are checked
        assert ctx.rows >= rows
        ctx.set_rows(ROWS)
    y = torch.randn(n, 16, generator=g)
    torch.testing.assert_close(plain.add(x, y), _want(x, y, single), rtol=1e-5, atol=1e-5)
    parts = [torch.randn(n, 12, generator=g), torch.randn(n, 8), torch.randn(n, 20)]
    got = fused.add_parts(x, parts)
    torch.testing.assert_close(got[0], _want(x, parts[0], q), rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], parts[1])  # the untargeted part is untouched
    torch.testing.assert_close(got[2], _want(x, parts[2], v, (1,)), rtol=1e-5, atol=1e-5)
    stacked = fused.add_stacked(x, torch.cat(parts, dim=1))
    torch.testing.assert_close(stacked, torch.cat(got, dim=1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("always", [False, True])
def test_no_adapter_in_the_step_skips_outside_a_capture(always):
    ctx = LoraContext(2, torch.device("cpu"))
    ctx.always = always  # (CUDA's mode: only a graph capture keeps the deltas)
    d = LoraDelta(ctx, [_part(_pairs(16, 1))])
    ctx.set_rows([((), 4)])
    y = torch.randn(4, 16)
    assert d.add(torch.randn(4, IN), y) is y and not ctx.active
