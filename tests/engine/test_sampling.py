"""Sampler: each filter against a direct computation on known logits, seeds, validation."""

import pytest
import torch

from localllm.engine.sampling import Sampler, SamplingParams


def _support(params: SamplingParams, logits: torch.Tensor, draws: int = 400) -> set[int]:
    s = Sampler(params)
    return {s(logits) for _ in range(draws)}


LOGITS = torch.log(torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04]))


def test_greedy_is_argmax():
    logits = torch.randn(1000)
    assert Sampler(SamplingParams(temperature=0.0))(logits) == int(logits.argmax())


def test_top_k_keeps_exactly_k():
    p = SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0, seed=0)
    assert _support(p, LOGITS) == {0, 1}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # cumulative: .40 .65 .80 .90 -> p=0.8 needs the first three tokens
    p = SamplingParams(temperature=1.0, top_k=0, top_p=0.8, min_p=0.0, seed=0)
    assert _support(p, LOGITS) == {0, 1, 2}


def test_min_p_is_relative_to_the_best_token():
    # 0.3 * 0.40 = 0.12 -> tokens with p >= 0.12: 0.40, 0.25, 0.15
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.3, seed=0)
    assert _support(p, LOGITS) == {0, 1, 2}


def test_temperature_sharpens_after_filtering():
    """Draw frequencies follow softmax(logits / T) over the kept tokens."""
    p = SamplingParams(temperature=0.5, top_k=0, top_p=1.0, min_p=0.0, seed=1)
    s = Sampler(p)
    n = 4000
    counts = torch.bincount(torch.tensor([s(LOGITS) for _ in range(n)]), minlength=6).float()
    expected = (LOGITS / 0.5).softmax(-1) * n
    assert torch.all((counts - expected).abs() <= 5 * expected.sqrt() + 5)


def test_seed_reproduces_and_differs():
    logits = torch.randn(5000)
    a = [Sampler(SamplingParams(seed=3, top_k=0, top_p=1.0, min_p=0.0))(logits) for _ in range(3)]
    assert len(set(a)) == 1
    s1 = Sampler(SamplingParams(seed=3, top_k=0, top_p=1.0, min_p=0.0))
    s2 = Sampler(SamplingParams(seed=4, top_k=0, top_p=1.0, min_p=0.0))
    assert [s1(logits) for _ in range(20)] != [s2(logits) for _ in range(20)]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1},
        {"top_k": -2},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"min_p": 2},
        {"max_tokens": -1},
    ],
)
def test_invalid_params_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
