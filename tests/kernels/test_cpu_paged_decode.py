"""The CPU's native decode attention (`kernels.cpu.paged_decode`) against the torch path of
`kernels.attention.paged`, and the property it exists for: a row's bits do not depend on the
rows beside it (identical sequences anywhere in a batch, or alone, give identical outputs)."""

import pytest
import torch

from localllm.kernels.attention import paged
from localllm.kernels.attention.decode_plan import host_tables
from localllm.kernels.cpu import paged_decode, prompt_attention

pytestmark = pytest.mark.skipif(
    paged_decode._lib() is None, reason="no C compiler: the torch path runs"
)


def _cache(blocks, bs, kvh, hd, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(blocks, bs, kvh, hd, generator=g).to(dtype)
    v = torch.randn(blocks, bs, kvh, hd, generator=g).to(dtype)
    return k, v


def _torch(q, k, v, lens, tables, scale, window):
    """The torch path, one sequence at a time (no native kernel)."""
    n = len(lens)
    return torch.cat(paged._each(q, k, v, list(range(n + 1)), lens, tables, scale, window,
                                 None, None, None, None, None))  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kvh", [(9, 3), (32, 1), (4, 4)])
@pytest.mark.parametrize("window", [None, 7])
def test_matches_the_torch_path(dtype, heads, kvh, window):
    bs, hd, blocks = 4, 64, 40
    k, v = _cache(blocks, bs, kvh, hd, dtype)
    lens = [1, 5, 13, 30]
    perm = torch.randperm(blocks, generator=torch.Generator().manual_seed(1)).tolist()
    tables, at = [], 0
    for n in lens:  # scattered, non-consecutive blocks
        nb = -(-n // bs)
        tables.append(perm[at : at + nb])
        at += nb
    q = torch.randn(len(lens), heads, hd, generator=torch.Generator().manual_seed(2))
    want = _torch(q, k, v, lens, tables, hd**-0.5, window)
    lt, tt = host_tables(lens, tables)
    got = paged_decode.paged_decode(q, k, v, lt, tt, hd**-0.5, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_bits_do_not_depend_on_its_neighbours(threads):
    bs, hd, heads, kvh = 16, 64, 9, 3
    k, v = _cache(8, bs, kvh, hd, torch.float32)
    k[1], v[1] = k[0], v[0]  # sequence 1's block holds the same keys as sequence 0's
    q1 = torch.randn(1, heads, hd, generator=torch.Generator().manual_seed(3))
    other = torch.randn(1, heads, hd, generator=torch.Generator().manual_seed(4))
    alone = paged_decode.paged_decode(q1, k, v, *host_tables([5], [[0]]), 0.125, None, threads)
    lens, tables = host_tables([9, 5, 5], [[2], [0], [1]])
    batch = paged_decode.paged_decode(torch.cat([other, q1, q1]), k, v, lens, tables, 0.125,
                                      None, threads)  # fmt: skip
    assert torch.equal(batch[1], alone[0]) and torch.equal(batch[2], alone[0])


def test_paged_attention_routes_decode_rows_and_prompt_rows_natively():
    """A mixed step (two decode rows, one prompt chunk) through `paged_attention`: the decode rows
    equal the native kernel's, identical ones identical; the chunk's rows equal the prompt
    kernel's (`kernels.cpu.prompt_attention`; with `CPU_PROMPT_ATTENTION = "rows"` this kernel's
    row by row, each over its own keys: issue 39, a prompt row's bits must not depend on its
    chunk), and the torch path's to float rounding."""
    bs, hd, heads, kvh = 4, 32, 4, 2
    k, v = _cache(12, bs, kvh, hd, torch.float32)
    k[1], v[1] = k[0], v[0]
    q = torch.randn(6, heads, hd, generator=torch.Generator().manual_seed(5))
    q[1] = q[0]
    qs, lens, tables = (0, 1, 2, 6), (3, 3, 8), ((0,), (1,), (4, 5))
    out = paged.paged_attention(q, k, v, qs, lens, tables, hd**-0.5)
    assert torch.equal(out[0], out[1])
    tiled = prompt_attention.prompt_attention(q[2:6], k, v, (0, 4), (8,), ((4, 5),), hd**-0.5)
    assert torch.equal(out[2:6], tiled)
    rows = paged_decode.paged_decode(q[2:6], k, v, *host_tables([5, 6, 7, 8], [[4, 5]] * 4),
                                     hd**-0.5)  # fmt: skip
    old, paged.CPU_PROMPT_ATTENTION = paged.CPU_PROMPT_ATTENTION, "rows"
    try:
        assert torch.equal(paged.paged_attention(q, k, v, qs, lens, tables, hd**-0.5)[2:6], rows)
    finally:
        paged.CPU_PROMPT_ATTENTION = old
    chunk = paged._each(q[2:6], k, v, (0, 4), (8,), ((4, 5),), hd**-0.5, None, None, None, None,
                        None, None)[0]  # fmt: skip
    torch.testing.assert_close(out[2:6], chunk, rtol=1e-5, atol=1e-5)
    ref = _torch(q[:2], k, v, [3, 3], [[0], [1]], hd**-0.5, None)
    torch.testing.assert_close(out[:2], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("lens", [[13], [3, 21, 9, 30, 5]])
def test_a_graph_plan_gives_the_eager_steps_bits(lens, window):
    """A decode graph's padded plan on the CPU (`DecodeGraphs.forward` run eagerly: host tables,
    placeholder lengths in the batch) takes the native kernel too, so each row has the eager
    step's bits: the torch gather it took before differed by ~1e-6, which the int8 activations
    of the next linear turned into 4e-3 logit flips (tests/engine/test_graph_ladder.py)."""
    from localllm.kernels.attention.decode_graph import PaddedPositions, padded_decode_plan
    from localllm.kernels.attention.decode_plan import plan_decode

    bs, hd, heads, kvh, width = 4, 32, 8, 2, 16
    k, v = _cache(48, bs, kvh, hd, torch.float32, seed=6)
    perm = torch.randperm(48, generator=torch.Generator().manual_seed(7)).tolist()
    tables = [perm[8 * i : 8 * i + -(-n // bs)] for i, n in enumerate(lens)]
    q = torch.randn(len(lens), heads, hd, generator=torch.Generator().manual_seed(8))
    n, qs = len(lens), tuple(range(len(lens) + 1))
    eager = paged.paged_attention(q, k, v, qs, lens, tables, hd**-0.5, window,
                                  decode=plan_decode(qs, lens, tables, bs, window))  # fmt: skip
    padded = torch.tensor([t + perm[: width - len(t)] for t in tables])  # any valid ids past
    plan = padded_decode_plan(padded, torch.tensor(lens), PaddedPositions.make(width, bs, "cpu"),
                              bs, window)  # fmt: skip
    graph = paged.paged_attention(q, k, v, qs, (1,) * n, ((0,),) * n, hd**-0.5, window,
                                  decode=plan)  # fmt: skip
    assert torch.equal(graph, eager)
