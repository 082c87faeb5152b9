"""The LoRA expand in the packed dp4a GEMVs' epilogue (`kernels.quant.triton_lora_tail`) against
its references: the GEMV's oracle `gemv_q8x_reference` plus `lora_delta.tail_reference`, after
`triton_lora.shrink` filled the module's scratch t. Q4_K, Q6_K and Q8_0; one to three output
parts in one GEMV (q | k | v), part boundaries inside a tile, a part no adapter targets, ranks
16 to 64 (several adapters stacked), one and four rows (a row on no adapter), with and without
split K, the shrink launched before or run inline by the GEMV; two GEMVs reading one t (a
module whose parts have two ggml types): t and its counters are zero only after the second.
Runs on CUDA (marked `gpu`) or under TRITON_INTERPRET=1 with CPU tensors (small shapes)."""

import numpy as np
import pytest
import torch

from localllm.kernels.fused.lora_delta import (
    LoraPart,
    make_tail,
    scratch,
    shrink_expand_reference,
    tail_reference,
)
from localllm.kernels.quant import QuantType
from localllm.kernels.quant.repack import pack_blocks
from tests.triton_env import DEVICE, INTERPRET, TRITON_MARKS

pytestmark = TRITON_MARKS

K = 512 if INTERPRET else 4096
CASES = [  # (type, rows, part columns, part ranks (0: no adapter), split K)
    ("Q4_K", 1, [96], [16], False),
    ("Q4_K", 1, [72, 24, 24], [16, 16, 16], True),  # q | k | v, boundaries inside tile 1
    ("Q6_K", 4, [40, 56], [32, 0], True),  # gate | up, an adapter on gate only
    ("Q8_0", 3, [64, 40], [64, 48], False),  # four rank-16 adapters on one part
]


def _weight(make_blocks, name, n, seed):
    qt = QuantType[name]
    block = 32 if name == "Q8_0" else 256
    raw = torch.from_numpy(make_blocks(name, n, K // block, np.random.default_rng(seed)))
    return qt, raw.reshape(n, -1)


def _adapters(rows, cols, ranks, seed):
    g = torch.Generator().manual_seed(seed)
    r = sum(ranks)
    x = torch.randn(rows, K, generator=g)
    a = (0.05 * torch.randn(r, K, generator=g)).half()
    w = torch.randn(rows + 2, r, generator=g)
    if rows > 1:
        w[1] = 0.0  # a row on no adapter
    parts, lo = [], 0
    for n, rank in zip(cols, ranks, strict=True):
        b = (0.1 * torch.randn(rank, n, generator=g)).half()
        parts.append(LoraPart(lo, lo + rank, b) if rank else None)
        lo += rank
    return x, a, w, parts


def _cfg(qt, n, split: bool):
    from localllm.kernels.quant.triton_packed import packed_config

    cfg = packed_config(qt, n, K)
    if not split:  # one program per column tile: every program runs the epilogue
        nb = K // (32 if qt == QuantType.Q8_0 else 256)
        cfg = type(cfg)(cfg.block_n, cfg.num_warps, nb)
    return cfg


def _delta(x, a, w, parts, cols):
    on = [p for p in parts if p is not None]
    ys = [torch.zeros(x.shape[0], c) for c in cols]
    shrink_expand_reference(x, a, w, on, [y2 for y2, p in zip(ys, parts, strict=True) if p])
    return torch.cat(ys, dim=1)


@pytest.mark.parametrize("inline", [False, True], ids=["shrink-launched", "shrink-inline"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-T{c[1]}-{len(c[2])}parts")
def test_epilogue_matches_reference(case, inline, make_blocks):
    """The shrink launched before the GEMV, or inline (its items done by the first programs to
    take a ticket, the tile finishers waiting for them: `SCHEME = "inline"`)."""
    import dataclasses

    from localllm.kernels.fused.triton_lora import shrink
    from localllm.kernels.quant.q8x_reference import gemv_q8x_reference
    from localllm.kernels.quant.triton_packed import gemv_packed, split_counters

    name, rows, cols, ranks, split = case
    n = sum(cols)
    qt, raw = _weight(make_blocks, name, n, seed=n)
    x, a, w, parts = _adapters(rows, cols, ranks, seed=rows)
    delta = _delta(x, a, w, parts, cols)
    want = gemv_q8x_reference(x, raw, qt, n, K).float() + delta
    p = pack_blocks(raw.to(DEVICE), qt, n, K)
    cfg = _cfg(qt, n, split)
    dev_parts = [None if q is None else LoraPart(q.lo, q.hi, q.b_t.to(DEVICE)) for q in parts]
    pad = scratch(a.shape[0], DEVICE)
    tiles = -(-n // cfg.block_n)
    tail = make_tail(pad, list(zip(cols, dev_parts, strict=True)), tiles)
    xd, ad, wd = x.to(DEVICE), a.to(DEVICE), w.to(DEVICE)
    if inline:
        tail = dataclasses.replace(tail, a=ad, w=wd)
    for call in range(2):  # the second call finds t and the counters clean
        if not inline:
            shrink(xd, ad, wd, pad)
        t_now = pad[0].clone()
        counters = split_counters(p, cfg)
        got = gemv_packed(xd, p, cfg, counters, lora=tail).cpu()
        assert not pad[0].any() and not pad[1].any(), f"call {call}: scratch left dirty"
        assert not counters.any()
        base = gemv_packed(xd, p, cfg, split_counters(p, cfg)).cpu()
        if not inline:  # the epilogue adds exactly the tail of the t the shrink made
            ref = tail_reference(base, _with_t(tail, t_now))
        else:
            ref = base + delta
        assert (got - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())
        tol = 1e-3 * want.norm().item()  # the oracle quantizes x as the kernel does
        assert (got - want).norm().item() < tol
        assert (got - base).abs().max().item() > 1e-2  # the delta is really there
        if rows > 1:
            assert torch.equal(got[1], base[1])  # a row on no adapter: the base alone


def _with_t(tail, t):
    import dataclasses

    return dataclasses.replace(tail, t=t.cpu(), b=tail.b.cpu())


@pytest.mark.parametrize("inline", [False, True], ids=["shrink-launched", "shrink-inline"])
def test_two_gemvs_share_one_t(inline, make_blocks):
    """q | k in one GEMV type and v in another (Q4_K_M's Q6_K attn_v): both read t; the second
    GEMV's last tile zeroes it (inline: the first GEMV runs the shrink)."""
    import dataclasses

    from localllm.kernels.fused.triton_lora import shrink
    from localllm.kernels.quant.triton_packed import gemv_packed, packed_config, split_counters

    cols, ranks = [64, 32, 32], [16, 16, 16]
    x, a, w, parts = _adapters(1, cols, ranks, seed=5)
    qk_t, qk = _weight(make_blocks, "Q4_K", 96, seed=1)
    v_t, v = _weight(make_blocks, "Q6_K", 32, seed=2)
    dev = [LoraPart(q.lo, q.hi, q.b_t.to(DEVICE)) for q in parts]
    packs = [pack_blocks(qk.to(DEVICE), qk_t, 96, K), pack_blocks(v.to(DEVICE), v_t, 32, K)]
    cfgs = [packed_config(p.qtype, p.n, K) for p in packs]
    tiles = sum(-(-p.n // c.block_n) for p, c in zip(packs, cfgs, strict=True))
    pad = scratch(a.shape[0], DEVICE)
    tails = [make_tail(pad, [(64, dev[0]), (32, dev[1])], tiles)]
    tails.append(make_tail(pad, [(32, dev[2])], tiles))
    if inline:
        tails[0] = dataclasses.replace(tails[0], a=a.to(DEVICE), w=w.to(DEVICE))
    else:
        shrink(x.to(DEVICE), a.to(DEVICE), w.to(DEVICE), pad)
    got = []
    for p, c, tail in zip(packs, cfgs, tails, strict=True):
        got.append(gemv_packed(x.to(DEVICE), p, c, split_counters(p, c), lora=tail).cpu())
        if len(got) == 1:
            assert pad[0].any()  # the first GEMV leaves t for the second
    assert not pad[0].any() and not pad[1].any()
    ys = [torch.zeros(1, c) for c in cols]
    shrink_expand_reference(x, a, w, parts, ys)
    for p, c, g, y in zip(packs, cfgs, got, [torch.cat(ys[:2], 1), ys[2]], strict=True):
        base = gemv_packed(x.to(DEVICE), p, c, split_counters(p, c)).cpu()
        want = base + y
        assert (g - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())
        assert (g - base).abs().max().item() > 1e-2  # the delta is really there


def test_epilogue_rejects_long_steps(make_blocks):
    from localllm.kernels.quant.triton_packed import MAX_ROWS, gemv_packed

    qt, raw = _weight(make_blocks, "Q8_0", 64, seed=3)
    p = pack_blocks(raw.to(DEVICE), qt, 64, K)
    tail = make_tail(scratch(16, DEVICE), [(64, LoraPart(0, 16, torch.zeros(16, 64).half()))], 1)
    with pytest.raises(ValueError, match="LoRA epilogue takes"):
        gemv_packed(torch.zeros(MAX_ROWS + 1, K, device=DEVICE), p, lora=tail)


@pytest.mark.parametrize("early", [False, True], ids=["finisher", "early"])
@pytest.mark.parametrize("np_", [1, 5, 56], ids=lambda n: f"{n}partials")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-T{c[1]}-{len(c[2])}parts")
def test_epilogue_sums_partial_shrinks(case, np_, early, make_blocks, monkeypatch):
    """`PARTIAL_SHRINK`'s tails: t is the sum of a producer's np partials ([rows, R, PS], the
    ones past np NaN: never read); the epilogue adds that t's delta, counts and zeroes nothing
    (the partials and the scratch's counters are as they were), and a second call gives the
    same bits. "early" (`EARLY_TAIL`): a split-K GEMV adds it into split 0's partial sum."""
    import dataclasses

    from localllm.kernels.fused.lora_delta import PARTIALS, partials
    from localllm.kernels.quant import triton_lora_tail

    monkeypatch.setattr(triton_lora_tail, "EARLY_TAIL", early)
    from localllm.kernels.quant.q8x_reference import gemv_q8x_reference
    from localllm.kernels.quant.triton_packed import gemv_packed, split_counters

    name, rows, cols, ranks, split = case
    n = sum(cols)
    qt, raw = _weight(make_blocks, name, n, seed=n)
    x, a, w, parts = _adapters(rows, cols, ranks, seed=rows)
    want = gemv_q8x_reference(x, raw, qt, n, K).float() + _delta(x, a, w, parts, cols)
    p = pack_blocks(raw.to(DEVICE), qt, n, K)
    cfg = _cfg(qt, n, split)
    dev_parts = [None if q is None else LoraPart(q.lo, q.hi, q.b_t.to(DEVICE)) for q in parts]
    pad = scratch(a.shape[0], DEVICE)
    tail = make_tail(pad, list(zip(cols, dev_parts, strict=True)), -(-n // cfg.block_n))
    # the shrink's t split into np random shares (what a producer's programs store)
    t = (x.float() @ a.float().T) * w[:rows]
    g = torch.Generator().manual_seed(np_)
    shares = torch.randn(rows, t.shape[1], np_, generator=g)
    shares[..., -1] += t - shares.sum(-1)
    shares[w[:rows] == 0] = 0.0  # a producer's shares of a row on no adapter: times W = 0
    buf = partials(a.shape[0], 4, "cpu").fill_(float("nan"))
    buf[:rows, :, :np_] = shares
    buf = buf.to(DEVICE)
    before = buf.clone()
    tail = dataclasses.replace(tail, t=buf, np=np_, ps=PARTIALS)
    xd = x.to(DEVICE)
    base = gemv_packed(xd, p, cfg, split_counters(p, cfg)).cpu()
    ref = tail_reference(base, _with_t(tail, buf))
    outs = []
    for _ in range(2):
        counters = split_counters(p, cfg)
        outs.append(gemv_packed(xd, p, cfg, counters, lora=tail).cpu())
        assert torch.equal(buf.isnan(), before.isnan())
        assert torch.equal(buf.nan_to_num(), before.nan_to_num())  # nothing zeroed
        assert not pad[0].any() and not pad[1].any() and not counters.any()
    got = outs[0]
    assert torch.equal(outs[0], outs[1])
    assert not got.isnan().any()
    assert (got - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())
    assert (got - want).norm().item() < 1e-3 * want.norm().item()
    assert (got - base).abs().max().item() > 1e-2  # the delta is really there
    if rows > 1:
        assert torch.equal(got[1], base[1])  # a row on no adapter: the base alone
