"""A CPU MoE layer's prompt rows (`kernels/cpu/moe_prompt.py`): experts with at least
`GEMM_MIN_ROWS` rows in the call through the int16 prompt GEMM, the others through the decode
kernels, against the dense float64 oracle and against the decode kernels' own outputs; a step
mixing prompt and decode rows; fetches in chunks."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from localllm.kernels.cpu import moe_prompt
from localllm.kernels.moe import ExpertFormat, expert_ffn_reference
from localllm.kernels.quant import QuantType
from localllm.kernels.quant.linear_native import prompt_rows
from tests.perf.make_synthetic import random_rows

DIM, HIDDEN, N_EXPERT = 256, 512, 6


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _layer(types, seed: int):
    rng = np.random.default_rng(seed)
    shapes = ((HIDDEN, DIM), (HIDDEN, DIM), (DIM, HIDDEN))
    return tuple(
        torch.from_numpy(np.stack([random_rows(types[i], r, c, rng) for _ in range(N_EXPERT)]))
        for i, (r, c) in enumerate(shapes)
    )


def _routing(tokens: int, seed: int, third: bool = True):
    """Experts 0 and 1 on every row (many rows: the GEMM), with `third` a third choice spread over
    2-5 (few rows each: the decode kernels)."""
    gen = torch.Generator().manual_seed(seed)
    cols = [torch.zeros(tokens, dtype=torch.long), torch.ones(tokens, dtype=torch.long)]
    cols += [2 + torch.arange(tokens) % 4] if third else []
    w = torch.softmax(torch.randn(tokens, len(cols), generator=gen), -1)
    return torch.randn(tokens, DIM, generator=gen), w, torch.stack(cols, 1)


@pytest.mark.parametrize(
    ("types", "act"),
    [((QT.Q4_K, QT.Q4_K, QT.Q6_K), "silu"), ((QT.Q6_K, QT.Q4_K, QT.Q8_0), "gelu")],
)
def test_prompt_rows_match_the_oracle_closer_than_the_decode_kernels(kernels, types, act):
    g, u, d = _layer(types, seed=1)
    qt = tuple(QuantType(t) for t in types)
    fmt = ExpertFormat(*qt, DIM, HIDDEN, act)
    errors = []
    for third in (False, True):  # experts 0, 1: 40 rows each; with third, 2-5: 10 each
        x, w, ids = _routing(40, seed=1, third=third)
        want = expert_ffn_reference(x, w, ids, g, u, d, fmt)
        decode = kernels.moe_ffn(x, w, ids, g, u, d, qt, act)
        with prompt_rows(True):
            got = kernels.moe_ffn(x, w, ids, g, u, d, qt, act)
            assert torch.equal(kernels.moe_ffn(x, w, ids, g, u, d, qt, act, threads=1), got)
        assert want.abs().max() > 1e-3 and not torch.equal(got, decode)
        errors.append((_rel(got, want), _rel(decode, want)))
    # all through the GEMM: int16 activations, far nearer exact math than the int8 kernels'
    # 1-1.5 % (measured ~1e-4); beside decode-kernel experts: in between
    (gemm, decode), (mixed, decode_mixed) = errors
    assert gemm < 2e-3 and gemm < 0.2 * decode, errors
    assert mixed < 0.8 * decode_mixed, errors


def test_experts_of_few_rows_keep_the_decode_kernels(kernels, monkeypatch):
    types = (QuantType.Q4_K, QuantType.Q4_K, QuantType.Q6_K)
    g, u, d = _layer(types, seed=2)
    x, w, ids = _routing(12, seed=2)  # every expert under GEMM_MIN_ROWS rows
    decode = kernels.moe_ffn(x, w, ids, g, u, d, types)
    with prompt_rows(True):
        assert torch.equal(kernels.moe_ffn(x, w, ids, g, u, d, types), decode)
    monkeypatch.setattr(moe_prompt, "GEMM_MIN_ROWS", 1)  # all through the GEMM: other bits
    with prompt_rows(True):
        assert not torch.equal(kernels.moe_ffn(x, w, ids, g, u, d, types), decode)


def test_a_mixed_step_gives_each_kind_its_own_path(kernels):
    types = (QuantType.Q4_K, QuantType.Q4_K, QuantType.Q6_K)
    g, u, d = _layer(types, seed=3)
    x, w, ids = _routing(48, seed=3)
    mask = torch.arange(48) < 40  # 40 prompt rows, then 8 decode rows
    with prompt_rows(mask):
        got = kernels.moe_ffn(x, w, ids, g, u, d, types)
    with prompt_rows(True):
        prompt = kernels.moe_ffn(x[:40], w[:40], ids[:40], g, u, d, types)
    decode = kernels.moe_ffn(x[40:], w[40:], ids[40:], g, u, d, types)
    assert torch.equal(got[:40], prompt) and torch.equal(got[40:], decode)


def test_fetches_in_chunks_give_the_same_bits(kernels):
    types = (QuantType.Q4_K, QuantType.Q4_K, QuantType.Q6_K)
    g, u, d = _layer(types, seed=4)
    x, w, ids = _routing(40, seed=4)
    with prompt_rows(True):
        whole = kernels.moe_ffn(x, w, ids, g, u, d, types)
        for at_once in (1, 4):
            got = kernels.moe_ffn_fetched(x, w, ids, lambda es: [(g[e], u[e], d[e]) for e in es],
                                          types, at_once=at_once)  # fmt: skip
            assert torch.equal(got, whole), at_once
