"""The CPU prompt attention kernel (`kernels.cpu.prompt_attention`, issue 39) against its float64
torch reference, and the property it exists for: a prompt row's bits depend only on its own
query, position, context and the cache, not on the chunk it came in (1, 2, 7, 64 rows or the
whole prompt), its place in a tile, the other rows or the thread count."""

import pytest
import torch

from localllm.kernels.attention import paged
from localllm.kernels.attention.decode_plan import host_tables
from localllm.kernels.cpu import paged_decode, prompt_attention
from localllm.kernels.cpu.prompt_attention import prompt_attention_reference

pytestmark = pytest.mark.skipif(
    prompt_attention.load() is None, reason="no C compiler: the row-by-row path runs"
)

BS = 16


def _case(n, heads, kvh, hd, dtype, seed=0, extra_blocks=2):
    """q [n, heads, hd] and caches holding n keys in scattered blocks; the block table."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-n // BS) + extra_blocks
    k = torch.randn(nb, BS, kvh, hd, generator=g).to(dtype)
    v = torch.randn(nb, BS, kvh, hd, generator=g).to(dtype)
    table = torch.randperm(nb, generator=g).tolist()
    q = torch.randn(n, heads, hd, generator=g)
    return q, k, v, table


def _chunks(q, k, v, table, size, window, threads=None):
    """The prompt's rows in chunks of `size`, each over the keys up to its last row."""
    n, outs = q.shape[0], []
    for a in range(0, n, size):
        b = min(n, a + size)
        outs.append(prompt_attention.prompt_attention(q[a:b], k, v, (0, b - a), (b,), (table,),
                                                      0.125, window, threads))  # fmt: skip
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kvh,hd", [(4, 4, 64), (16, 4, 32), (16, 2, 64), (6, 2, 40),
                                          (32, 1, 16)])  # fmt: skip
@pytest.mark.parametrize("window", [None, 7, 40])
def test_matches_the_float64_reference(dtype, heads, kvh, hd, window):
    """Two sequences in one call (a chunk starting mid-prompt, a whole prompt), scattered
    blocks; GQA groups 1, 4, 8, 3 and 32 (a group wider than a tile), a head size off the lanes."""
    q, k, v, table = _case(70, heads, kvh, hd, dtype)
    q2 = torch.randn(23, heads, hd, generator=torch.Generator().manual_seed(9))
    qq = torch.cat([q[40:], q2])
    qs, lens, tables = (0, 30, 53), (70, 23), (table, table[::-1])
    want = prompt_attention_reference(qq, k, v, qs, lens, tables, hd**-0.5, window)
    got = prompt_attention.prompt_attention(qq, k, v, qs, lens, tables, hd**-0.5, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kvh", [(8, 8), (16, 4), (16, 2)])
@pytest.mark.parametrize("window", [None, 9])
def test_a_rows_bits_do_not_depend_on_its_chunk(dtype, heads, kvh, window):
    q, k, v, table = _case(150, heads, kvh, 64, dtype)
    whole = _chunks(q, k, v, table, 150, window)
    for size in (1, 2, 7, 64):
        got = _chunks(q, k, v, table, size, window)
        assert torch.equal(got, whole), (size, (got - whole).abs().max().item())


@pytest.mark.parametrize("heads,kvh", [(8, 8), (16, 4), (16, 2)])
def test_a_rows_bits_do_not_depend_on_its_tile_place_or_neighbours(heads, kvh):
    """The chunk's tail from each of the first 20 rows (every place in a tile), and the chunk
    with every other row's query replaced, and two sequences in one call."""
    q, k, v, table = _case(90, heads, kvh, 64, torch.float32)
    whole = _chunks(q, k, v, table, 90, None)
    for a in range(20):
        got = prompt_attention.prompt_attention(q[a:], k, v, (0, 90 - a), (90,), (table,), 0.125)
        assert torch.equal(got, whole[a:]), a
    other = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    other[::2] = q[::2]
    got = _chunks(other, k, v, table, 90, None)
    assert torch.equal(got[::2], whole[::2])
    both = prompt_attention.prompt_attention(torch.cat([q[60:], q[10:50]]), k, v, (0, 30, 70),
                                             (90, 50), (table, table), 0.125)  # fmt: skip
    assert torch.equal(both[:30], whole[60:]) and torch.equal(both[30:], whole[10:50])


@pytest.mark.parametrize("window", [None, 20])
def test_one_thread_and_two_give_the_same_bits(window):
    q, k, v, table = _case(100, 32, 8, 64, torch.float16)
    one = _chunks(q, k, v, table, 100, window, threads=1)
    two = _chunks(q, k, v, table, 100, window, threads=2)
    assert torch.equal(one, two)
    assert torch.equal(_chunks(q, k, v, table, 13, window, threads=2), one)


def test_bad_tables_are_refused():
    q, k, v, table = _case(40, 4, 4, 16, torch.float32)
    with pytest.raises(ValueError, match="sequence 0: 40 rows, 40 tokens, 2 blocks"):
        prompt_attention.prompt_attention(q, k, v, (0, 40), (40,), (table[:2],), 0.25)


def test_paged_attention_sends_prompt_rows_here_and_decode_rows_to_the_decode_kernel():
    """A step of a decode row, a one-row prompt tail and a prompt chunk (`prompt` flags): the
    prompt rows give this kernel's bits (the tail the same as inside the whole chunk), the
    decode row the decode kernel's; without flags a chunk is a prompt, a lone row a decode row."""
    q, k, v, table = _case(40, 8, 2, 32, torch.float32, extra_blocks=4)
    scale = 32**-0.5
    whole = prompt_attention.prompt_attention(q, k, v, (0, 40), (40,), (table,), scale)
    dec = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(7))
    qq = torch.cat([dec, q[39:], q[20:]])
    qs, lens, tables = (0, 1, 2, 22), (40, 40, 40), (table, table, table)
    out = paged.paged_attention(qq, k, v, qs, lens, tables, scale, prompt=(False, True, True))
    assert torch.equal(out[1], whole[39]) and torch.equal(out[2:], whole[20:])
    want = paged_decode.paged_decode(dec, k, v, *host_tables([40], [table]), scale)
    assert torch.equal(out[:1], want)
    plain = paged.paged_attention(qq, k, v, qs, lens, tables, scale)
    rows = paged_decode.paged_decode(qq[:2], k, v, *host_tables([40, 40], [table] * 2), scale)
    assert torch.equal(plain[2:], whole[20:]) and torch.equal(plain[:2], rows)
