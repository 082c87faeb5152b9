"""Draws on the device (`engine.sampling.device`) against the host sampler's reference
(`sampler.candidates` + `sampler.draw`): the same token for the same logits, controls and uniform.
"""

import dataclasses

import pytest
import torch

from localllm.engine.sampling.device import DeviceDraw, sample, tokens
from localllm.engine.sampling.params import SamplingParams
from localllm.engine.sampling.sampler import Sampler, SamplingRow, candidates, draw

PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.3, top_k=40),
    SamplingParams(temperature=0.5, min_p=0.05),
    SamplingParams(temperature=0.8, top_k=100, top_p=0.8, min_p=0.02),
    SamplingParams(temperature=2.0, top_p=0.5, min_p=0.1),
    SamplingParams(temperature=1e-4),
]


def _logits(rows: int, vocab: int, seed: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 3
    x = (x * 4).round() / 4  # many exact ties: the order among them must be by id
    x[:, ::7] = float("-inf")  # masked ids are never drawn
    return x.to(dtype)


def _host(x: torch.Tensor, p: SamplingParams, u: float) -> int:
    return draw(*candidates(x, p), u)


def test_device_draw_equals_host_reference_exactly_in_float64():
    x = _logits(len(PARAMS) * 40, 3000, 0, torch.float64)
    g = torch.Generator().manual_seed(1)
    u = torch.rand(x.shape[0], generator=g, dtype=torch.float64).tolist()
    params = [PARAMS[i % len(PARAMS)] for i in range(x.shape[0])]
    got = sample(x, params, u).tolist()
    want = [_host(x[i], params[i], u[i]) for i in range(x.shape[0])]
    assert got == want
    assert len(set(got)) > 100  # the draws spread, not one id


def test_device_draw_in_float32_differs_only_at_rounding():
    x = _logits(len(PARAMS) * 40, 3000, 2, torch.float32)
    g = torch.Generator().manual_seed(3)
    u = torch.rand(x.shape[0], generator=g).tolist()
    params = [PARAMS[i % len(PARAMS)] for i in range(x.shape[0])]
    got = sample(x, params, u).tolist()
    want = [_host(x[i], params[i], u[i]) for i in range(x.shape[0])]
    assert sum(a != b for a, b in zip(got, want, strict=True)) <= 2


def test_tokens_mix_argmax_and_draws_and_restore_puts_generators_back():
    x = _logits(4, 500, 4, torch.float32)
    gens = [torch.Generator().manual_seed(s) for s in (5, 6)]
    d = DeviceDraw.draw([1, 3], [PARAMS[1], PARAMS[2]], gens)
    best, ids = tokens(x, d)
    assert torch.equal(best, x.max(-1).values)
    assert ids[0] == x[0].argmax() and ids[2] == x[2].argmax()
    assert ids[1] == _host(x[1].double(), PARAMS[1], d.u[0])
    assert ids[3] == _host(x[3].double(), PARAMS[2], d.u[1])
    d.restore()
    assert [float(torch.rand((), generator=g)) for g in gens] == d.u


@pytest.mark.parametrize("device_draws", [True, False])
def test_sampler_draws_one_uniform_per_row_either_way(device_draws):
    x = _logits(3, 800, 7, torch.float32)
    p = dataclasses.replace(PARAMS[4], seed=3)
    rows = [
        SamplingRow(p, torch.Generator().manual_seed(i), [1], [], frozenset()) for i in range(3)
    ]
    out = Sampler(device_draws)(x, rows)
    for i, row in enumerate(rows):
        u = float(torch.rand((), generator=torch.Generator().manual_seed(i)))
        assert out[i].token_id == _host(x[i].double(), p, u)
        # the row's generator advanced by exactly one draw
        nxt = torch.Generator().manual_seed(i)
        torch.rand((), generator=nxt)
        assert torch.equal(row.rng.get_state(), nxt.get_state())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_draw_on_a_gpu_equals_host_reference():
    x = _logits(len(PARAMS) * 40, 151936 // 8, 8, torch.float32)
    g = torch.Generator().manual_seed(9)
    u = torch.rand(x.shape[0], generator=g).tolist()
    params = [PARAMS[i % len(PARAMS)] for i in range(x.shape[0])]
    got = sample(x.cuda(), params, u).tolist()
    want = [_host(x[i].double(), params[i], u[i]) for i in range(x.shape[0])]
    assert sum(a != b for a, b in zip(got, want, strict=True)) <= 2


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_row_with_no_finite_maximum_is_a_clear_error_not_a_fault(bad):
    x = _logits(2, 300, 10, torch.float32)
    if bad == float("-inf"):
        x[1] = bad  # nothing to sample
    else:
        x[1, 17] = bad
    _, ids = tokens(x, DeviceDraw.draw([0, 1], PARAMS[:2], [torch.Generator()] * 2))
    assert 0 <= int(ids[1]) < 300  # indexed inside the row (a GPU would fault otherwise)
    rows = [SamplingRow(PARAMS[1], torch.Generator(), [1], [], frozenset()) for _ in range(2)]
    with pytest.raises(ValueError, match="row 1"):
        Sampler(device_draws=True)(x, rows)
