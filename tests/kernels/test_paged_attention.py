"""kernels.attention: paged attention vs dense causal attention, paged writes, 8-bit KV formats.

The reference is textbook attention in float64 over each sequence's dense K/V (query heads mapped
to KV head h // group). The paged side gets random, non-contiguous block tables drawn from a pool
whose unused slots hold NaN, so reading any slot outside a sequence's context poisons the output.
"""

import math

import pytest
import torch

from localllm.kernels.attention import (
    decode_kv,
    dequantize_fp8,
    dequantize_q8_0,
    encode_kv,
    paged_attention,
    plan_decode,
    q8_group,
    quantize_fp8,
    quantize_q8_0,
    quantized_output,
    write_paged,
)

F32_TOL = 2e-5  # float32 paged math vs float64 reference (outputs of std ~0.4)
# (context length after the step, new tokens): first-token decode, decode deep in a sequence,
# a whole prompt, a chunk at an offset, a short chunk, a decode right at a block boundary.
SEQS = ((1, 1), (37, 1), (50, 50), (45, 13), (29, 5), (24, 1))


def dense_reference(q, k, v, scale, window=None, softcap=None):
    """q [t, H, D] at the last t positions of k/v [n, KV, D] -> [t, H, Dv] in float64."""
    t, h, _ = q.shape
    n, kvh, _ = k.shape
    heads = torch.arange(h) // (h // kvh)
    q, k, v = q.double(), k.double()[:, heads], v.double()[:, heads]  # [n, H, D]
    scores = torch.einsum("thd,nhd->htn", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    qpos = torch.arange(n - t, n)[:, None]
    keys = torch.arange(n)[None, :]
    allowed = keys <= qpos
    if window:
        allowed &= keys > qpos - window
    scores = scores.masked_fill(~allowed, -math.inf)
    return torch.einsum("htn,nhd->thd", scores.softmax(-1), v)


def random_tables(seq_lens, block_size, num_blocks, gen, consecutive_first=False):
    """Disjoint random block tables (shuffled pool); optionally the first one consecutive ids."""
    need = [-(-n // block_size) for n in seq_lens]
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables, i = [], 0
    for b, m in enumerate(need):
        if b == 0 and consecutive_first:
            tables.append(tuple(range(num_blocks - m, num_blocks)))
            pool = [x for x in pool if x < num_blocks - m]
            continue
        tables.append(tuple(pool[i : i + m]))
        i += m
    return tables


def read_slots(cache, slots):
    """cache[slot // block_size, slot % block_size] for each slot (None passes through)."""
    if cache is None:
        return None
    flat = cache.flatten(0, 1)
    if cache.dtype == torch.float8_e4m3fn:  # no float8 gather kernel on CPU: index the bytes
        return flat.view(torch.uint8)[slots].view(cache.dtype)
    return flat[slots]


def slots_of(table, block_size, positions):
    return torch.tensor([table[p // block_size] * block_size + p % block_size for p in positions])


def build(seqs, block_size, heads, kv_heads, d, dv, seed, consecutive_first=False):
    """Random q/k/v for `seqs`, a NaN-filled paged pool holding every context, and block tables."""
    gen = torch.Generator().manual_seed(seed)
    lens = [n for n, _ in seqs]
    num_blocks = sum(-(-n // block_size) for n in lens) + 5  # spare blocks stay NaN
    tables = random_tables(lens, block_size, num_blocks, gen, consecutive_first)
    k_cache = torch.full((num_blocks, block_size, kv_heads, d), math.nan)
    v_cache = torch.full((num_blocks, block_size, kv_heads, dv), math.nan)
    ks = [torch.randn(n, kv_heads, d, generator=gen) for n in lens]
    vs = [torch.randn(n, kv_heads, dv, generator=gen) for n in lens]
    qs = [torch.randn(t, heads, d, generator=gen) for _, t in seqs]
    for (n, _), table, k, v in zip(seqs, tables, ks, vs, strict=True):
        slots = slots_of(table, block_size, range(n))
        write_paged(k_cache, k, slots)
        write_paged(v_cache, v, slots)
    starts = [0]
    for _, t in seqs:
        starts.append(starts[-1] + t)
    return torch.cat(qs), k_cache, v_cache, starts, lens, tables, qs, ks, vs


@pytest.mark.parametrize("block_size", [16, 12])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (4, 4), (6, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (7, None), (None, 2.0), (20, 2.0)])
def test_paged_matches_dense_reference(block_size, heads, kv_heads, window, softcap):
    d, dv = 32, 24  # different value width, as MLA-style caches have
    q, kc, vc, starts, lens, tables, qs, ks, vs = build(
        SEQS, block_size, heads, kv_heads, d, dv, seed=block_size + heads, consecutive_first=True
    )
    scale = d**-0.5
    got = paged_attention(q, kc, vc, starts, lens, tables, scale, window, softcap)
    assert got.shape == (q.shape[0], heads, dv) and got.dtype == torch.float32
    assert torch.isfinite(got).all()  # no NaN slot outside any context was read
    for b, (qb, kb, vb) in enumerate(zip(qs, ks, vs, strict=True)):
        want = dense_reference(qb, kb, vb, scale, window, softcap)
        err = (got[starts[b] : starts[b + 1]].double() - want).abs().max().item()
        assert err < F32_TOL, f"sequence {b} (n={lens[b]}, t={len(qb)}): {err:.2e}"
        # the features change the answer, so ignoring one could not pass
        if window and lens[b] > window + 1:
            plain = dense_reference(qb, kb, vb, scale, None, softcap)
            assert (plain - want).abs().max() > 100 * F32_TOL
        if softcap is not None and lens[b] > 1:
            plain = dense_reference(qb, kb, vb, scale, window, None)
            assert (plain - want).abs().max() > 100 * F32_TOL


def test_tables_are_followed_not_assumed():
    """The same pool read through a different (wrong) table gives a different answer."""
    seqs = ((40, 1), (40, 3))
    q, kc, vc, starts, lens, tables, qs, ks, vs = build(seqs, 8, 4, 2, 16, 16, seed=9)
    got = paged_attention(q, kc, vc, starts, lens, tables, 0.25)
    swapped = paged_attention(q, kc, vc, starts, lens, tables[::-1], 0.25)
    for b in range(2):
        want = dense_reference(qs[b], ks[b], vs[b], 0.25)
        assert (got[starts[b] : starts[b + 1]].double() - want).abs().max() < F32_TOL
    assert (swapped - got).abs().max() > 1e-2


def test_write_paged_lands_at_slots():
    gen = torch.Generator().manual_seed(3)
    cache = torch.zeros(6, 12, 2, 8)
    slots = torch.tensor([70, 5, 12, 33, 71])  # any order, across blocks
    values = torch.randn(5, 2, 8, generator=gen)
    write_paged(cache, values, slots)
    written = torch.zeros(6, 12, dtype=torch.bool)
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(cache[s // 12, s % 12], values[i])
        written[s // 12, s % 12] = True
    assert (cache[~written] == 0).all()  # nothing else touched


@pytest.mark.parametrize("fmt", ["q8_0", "fp8"])
def test_write_paged_8bit_bytes(fmt):
    """8-bit values and their scales land at the slots bit for bit (fp8 goes through uint8)."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 2, 64, generator=gen)
    vals, scales = encode_kv(x, fmt)
    vcache = torch.zeros(4, 5, 2, 64, dtype=vals.dtype)
    scache = torch.zeros(4, 5, *scales.shape[1:], dtype=scales.dtype)
    slots = torch.tensor([19, 0, 7])
    write_paged(vcache, vals, slots)
    write_paged(scache, scales, slots)
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(vcache[s // 5, s % 5].view(torch.uint8), vals[i].view(torch.uint8))
        assert torch.equal(scache[s // 5, s % 5], scales[i])
    assert vcache.view(torch.uint8).count_nonzero() > 0


def heavy_tailed(shape, seed):
    """Head vectors with outlier channels, as real K has (a few dims ~10x the others)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen)
    x[..., ::13] *= 10.0
    return x


@pytest.mark.parametrize("d", [64, 128, 16])
def test_q8_0_round_trip_bound(d):
    """|x - deq(q(x))| <= amax_group / 254 * (1 + 2^-10): half a step of the fp16-rounded scale."""
    x = heavy_tailed((50, 4, d), seed=d)
    q, scale = quantize_q8_0(x)
    g = q8_group(d)
    assert q.dtype == torch.int8 and scale.dtype == torch.float16
    assert scale.shape == (50, 4, d // g)
    back = dequantize_q8_0(q, scale)
    amax = x.reshape(50, 4, d // g, g).abs().amax(-1, keepdim=True)
    err = (back - x).abs().reshape(50, 4, d // g, g)
    assert (err <= amax / 254 * (1 + 2**-10)).all()
    assert q.abs().amax() == 127  # the full int8 range is used
    # values on the grid of a power-of-two scale come back exactly; zeros stay zero
    grid = torch.randint(-127, 128, (3, d)).float() * 2**-5
    grid[:, ::g] = 127 * 2**-5  # each group's amax sets the scale to exactly 2^-5
    assert torch.equal(dequantize_q8_0(*quantize_q8_0(grid)), grid)
    assert torch.equal(dequantize_q8_0(*quantize_q8_0(torch.zeros(2, d))), torch.zeros(2, d))


def test_fp8_round_trip_bound():
    """e4m3 has 3 mantissa bits: |err| <= |x| * 2^-4 + scale * 2^-10 (the subnormal half-step)."""
    x = heavy_tailed((50, 4, 64), seed=5)
    q, scale = quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (50, 4)
    back = dequantize_fp8(q, scale)
    err = (back - x).abs()
    assert (err <= x.abs() * 2**-4 + scale[..., None] * 2**-10).all()
    assert torch.allclose(back.abs().amax(-1), x.abs().amax(-1))  # amax maps to 448 exactly
    assert torch.equal(dequantize_fp8(*quantize_fp8(torch.zeros(2, 64))), torch.zeros(2, 64))


def test_q8_0_is_more_accurate_than_fp8():
    """Measured relative RMS round-trip error at the same ~1.06 bytes per value: Gaussian head
    vectors q8_0 0.54% vs fp8 2.5%; with outlier channels (which set q8_0's group scale) q8_0
    1.0% vs fp8 1.9%. tests/perf/kv_accuracy.py measures the effect on real models."""

    def rel_rms(x, fmt):
        back = decode_kv(*encode_kv(x, fmt), torch.float32)
        return ((back - x).pow(2).mean() / x.pow(2).mean()).sqrt().item()

    gauss = torch.randn(200, 4, 64, generator=torch.Generator().manual_seed(6))
    heavy = heavy_tailed((200, 4, 64), seed=6)
    q8, f8 = rel_rms(gauss, "q8_0"), rel_rms(gauss, "fp8")
    assert 0 < q8 < f8 / 3, (q8, f8)
    q8, f8 = rel_rms(heavy, "q8_0"), rel_rms(heavy, "fp8")
    assert 0 < q8 < f8 / 1.5, (q8, f8)


@pytest.mark.parametrize(
    ("fmt", "tol"), [("f16", 3e-3), ("bf16", 2e-2), ("q8_0", 4e-2), ("fp8", 0.2)]
)
def test_low_precision_caches_match_their_decoded_values(fmt, tol):
    """Attention over a `fmt` cache == reference over the decoded K/V (f32 rounding only), and
    stays within `tol` of full-precision K/V: about twice the max measured over 3 seeds (f16 1.1e-3,
    bf16 8e-3, q8_0 1.8e-2, fp8 1.1e-1 on outputs of std ~0.4)."""
    seqs = ((37, 1), (45, 13), (20, 20))
    q, kc, vc, starts, lens, tables, qs, ks, vs = build(seqs, 16, 8, 2, 64, 64, seed=11)
    kq, ksc = encode_kv(kc.nan_to_num(0.0), fmt)
    vq, vsc = encode_kv(vc.nan_to_num(0.0), fmt)
    got = paged_attention(q, kq, vq, starts, lens, tables, 0.125, k_scales=ksc, v_scales=vsc)
    for b in range(len(seqs)):
        slots = slots_of(tables[b], 16, range(lens[b]))
        k_dec = decode_kv(read_slots(kq, slots), read_slots(ksc, slots), torch.float32)
        v_dec = decode_kv(read_slots(vq, slots), read_slots(vsc, slots), torch.float32)
        out = got[starts[b] : starts[b + 1]].double()
        assert (out - dense_reference(qs[b], k_dec, v_dec, 0.125)).abs().max() < F32_TOL
        err = (out - dense_reference(qs[b], ks[b], vs[b], 0.125)).abs().max().item()
        assert 0 < err < tol, f"{fmt} sequence {b}: {err:.2e}"


@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (6, 1)], ids=["gqa", "mqa"])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (7, None), (20, 2.0)])
def test_batched_decode_plan_matches_dense_reference(heads, kv_heads, window, softcap):
    """The one-gather decode pass (padded to the longest context, NaN-filled spare slots) gives
    each single-token sequence the dense answer, and the others still go one by one."""
    d, dv = 32, 24
    q, kc, vc, starts, lens, tables, qs, ks, vs = build(SEQS, 12, heads, kv_heads, d, dv, seed=5)
    plan = plan_decode(starts, lens, tables, 12, window)
    assert plan is not None and plan.pad is not None  # four decoders of different lengths
    assert plan.rows.tolist() == [starts[b] for b, (_, t) in enumerate(SEQS) if t == 1]
    got = paged_attention(q, kc, vc, starts, lens, tables, d**-0.5, window, softcap, decode=plan)
    assert torch.isfinite(got).all()
    for b, (qb, kb, vb) in enumerate(zip(qs, ks, vs, strict=True)):
        want = dense_reference(qb, kb, vb, d**-0.5, window, softcap)
        err = (got[starts[b] : starts[b + 1]].double() - want).abs().max().item()
        assert err < F32_TOL, f"sequence {b}: {err:.2e}"


@pytest.mark.parametrize("fmt", ["f16", "q8_0", "fp8"])
def test_batched_decode_plan_on_8bit_and_half_caches(fmt):
    seqs = ((37, 1), (5, 1), (20, 20), (64, 1))
    q, kc, vc, starts, lens, tables, _, _, _ = build(seqs, 16, 8, 2, 64, 64, seed=3)
    kq, ksc = encode_kv(kc.nan_to_num(0.0), fmt)
    vq, vsc = encode_kv(vc.nan_to_num(0.0), fmt)
    one_by_one = paged_attention(q, kq, vq, starts, lens, tables, 0.125, k_scales=ksc, v_scales=vsc)
    plan = plan_decode(starts, lens, tables, 16)
    batched = paged_attention(
        q, kq, vq, starts, lens, tables, 0.125, k_scales=ksc, v_scales=vsc, decode=plan
    )
    assert (batched - one_by_one).abs().max() < 1e-5


def test_plan_needs_two_decoders():
    assert plan_decode((0, 1, 9), (5, 8), ((0,), (1,)), 16) is None


def test_quantized_output_only_where_the_flash_kernel_writes_it():
    """CPU (no flash-decoding kernel): no buffers for the quantized rows, and buffers passed
    anyway are refused rather than left unwritten."""
    seqs = ((37, 1), (5, 1))
    q, kc, vc, starts, lens, tables, _, _, _ = build(seqs, 16, 8, 2, 64, 64, seed=4)
    plan = plan_decode(starts, lens, tables, 16)
    assert quantized_output(q, kc, vc, plan) is None
    with pytest.raises(ValueError, match="flash-decoding"):
        paged_attention(q, kc, vc, starts, lens, tables, 0.125, decode=plan, quant=object())
    with pytest.raises(ValueError, match="decode plan"):
        paged_attention(q, kc, vc, starts, lens, tables, 0.125, quant=object())
