"""Batch sampler: every control against a plain-python reference, seeds, logprobs, bad input."""

import math
from collections import Counter

import pytest
import torch

import localllm.engine.sampling.sampler as sampler_mod
from localllm.engine.sampling.params import SamplingParams
from localllm.engine.sampling.sampler import (
    SampledToken,
    Sampler,
    SamplingRow,
    candidates,
    draw,
    draw_from_head,
    process,
    prompt_logprobs,
)

INF = float("inf")


def _row(params=None, seed=0, prompt=(), output=(), eos=(), allowed=None, **kw) -> SamplingRow:
    params = params or SamplingParams(**kw)
    rng = None
    if not params.greedy:
        rng = torch.Generator()
        rng.manual_seed(seed)
    return SamplingRow(params, rng, list(prompt), list(output), frozenset(eos), allowed)


def _sample1(logits: torch.Tensor, row: SamplingRow) -> SampledToken:
    return Sampler()(logits[None], [row])[0]


# ---------------------------------------------------------------- references (plain python)


def ref_process(logits: torch.Tensor, row: SamplingRow) -> list[float]:
    p, x = row.params, logits.double().tolist()
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in range(len(x)):
        masked = p.allowed_token_ids is not None and t not in p.allowed_token_ids
        masked |= t in (p.banned_token_ids or ())
        masked |= row.allowed is not None and (t >= len(row.allowed) or not bool(row.allowed[t]))
        if len(row.output_ids) < p.min_tokens:
            masked |= t in row.eos_ids or t in p.stop_token_ids
        if masked:
            x[t] = -INF
    for t in set(row.prompt_ids) | set(row.output_ids):
        r = p.repetition_penalty
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t, c in Counter(row.output_ids).items():
        x[t] -= p.presence_penalty + p.frequency_penalty * c
    return x


def _softmax(vals: list[float]) -> list[float]:
    m = max(vals)
    e = [math.exp(v - m) for v in vals]
    return [v / sum(e) for v in e]


def ref_candidates(x: list[float], p: SamplingParams) -> tuple[list[int], list[float]]:
    items = sorted(((t, v) for t, v in enumerate(x) if v > -INF), key=lambda tv: (-tv[1], tv[0]))
    if p.top_k:
        items = items[: p.top_k]
    if p.typical_p < 1:
        probs = _softmax([v for _, v in items])
        ent = -sum(q * math.log(q) for q in probs if q > 0)
        order = sorted(range(len(items)), key=lambda i: (abs(-math.log(probs[i]) - ent), i))
        kept, cum = [], 0.0
        for i in order:
            kept.append(i)
            cum += probs[i]
            if cum >= p.typical_p:
                break
        items = [items[i] for i in sorted(kept)]
    if p.top_p < 1:
        probs, cum, n = _softmax([v for _, v in items]), 0.0, 0
        while n < len(items):
            cum += probs[n]
            n += 1
            if cum >= p.top_p:
                break
        items = items[:n]
    if p.min_p > 0:
        probs = _softmax([v for _, v in items])
        items = [it for it, q in zip(items, probs, strict=True) if q >= p.min_p * probs[0]]
    return [t for t, _ in items], _softmax([v / p.temperature for _, v in items])


# ---------------------------------------------------------------- processors


def test_penalties_hand_computed():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, 1.0])
    row = _row(
        temperature=0,
        repetition_penalty=2.0,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        prompt=[0, 1],
        output=[1, 1, 2],
    )
    # t0 prompt only: 2/2; t1: -1*2 - .5 - 2*.25; t2: .5/2 - .5 - .25; t3, t4 untouched
    assert process(logits, row).tolist() == [1.0, -3.0, -0.5, 3.0, 1.0]


@pytest.mark.parametrize(
    "kw",
    [
        dict(repetition_penalty=1.7),
        dict(repetition_penalty=0.6),
        dict(presence_penalty=0.8),
        dict(frequency_penalty=-0.4),
        dict(repetition_penalty=1.3, presence_penalty=-1.0, frequency_penalty=1.5),
        dict(logit_bias={3: 5.0, 17: -2.5}),
        dict(allowed_token_ids=(1, 4, 9, 30), banned_token_ids=(4,)),
    ],
)
def test_process_matches_reference(kw):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(32, generator=g) * 2
    row = _row(temperature=0, prompt=[1, 5, 5, 9, 20], output=[9, 3, 3, 3, 31, 5], **kw)
    got = process(logits, row)
    want = torch.tensor(ref_process(logits, row), dtype=torch.float32)
    assert torch.allclose(got, want, atol=1e-6)
    assert not torch.equal(got, logits)  # the control changed something


def test_logit_bias_flips_the_argmax():
    logits = torch.tensor([0.0, 5.0, 1.0, 2.0])
    assert _sample1(logits, _row(temperature=0)).token_id == 1
    assert _sample1(logits, _row(temperature=0, logit_bias={2: 4.5})).token_id == 2


def _draws(logits: torch.Tensor, row: SamplingRow, n: int) -> Counter:
    s = Sampler()
    return Counter(s(logits[None], [row])[0].token_id for _ in range(n))


def test_banned_id_never_sampled():
    logits = torch.tensor([0.0, 0.5, 0.2, 3.0, 0.1, -0.5, 0.3, 0.0])
    assert _draws(logits, _row(seed=3), 1000)[3] > 500  # it is the favourite otherwise
    assert _draws(logits, _row(seed=3, banned_token_ids=(3,)), 1000)[3] == 0


def test_allowed_ids_only():
    logits = torch.tensor([3.0, 0.5, 0.2, 3.0, 0.1, -0.5, 0.3, 0.0])
    got = _draws(logits, _row(seed=4, allowed_token_ids=(1, 5, 6)), 1000)
    assert set(got) == {1, 5, 6}


def test_grammar_mask_only_and_pads_with_disallowed():
    logits = torch.tensor([3.0, 0.5, 0.2, 3.0, 0.1, -0.5, 0.3, 9.0])  # id 7 past the grammar vocab
    mask = torch.tensor([False, True, False, False, True, False, True])
    assert set(_draws(logits, _row(seed=5, allowed=mask), 1000)) == {1, 4, 6}
    assert _sample1(logits, _row(temperature=0, allowed=mask)).token_id == 1


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.tensor([0.0, 1.0, 2.0, 5.0, 4.0])
    kw = dict(temperature=0, min_tokens=2, max_tokens=8, stop_token_ids=(4,))
    for n_out in (0, 1):
        assert _sample1(logits, _row(eos={3}, output=[0] * n_out, **kw)).token_id == 2
    assert _sample1(logits, _row(eos={3}, output=[0, 0], **kw)).token_id == 3
    sampled = _draws(logits, _row(seed=1, eos={3}, min_tokens=1, stop_token_ids=(4,)), 300)
    assert 3 not in sampled and 4 not in sampled


def test_wide_rows_treat_padding_ids_as_ordinary():
    logits = torch.zeros(10)
    logits[9] = 1.0
    assert _sample1(logits, _row(temperature=0)).token_id == 9
    assert _sample1(logits, _row(temperature=0, logit_bias={9: -2.0})).token_id == 0


# ---------------------------------------------------------------- filters and the draw

FILTERS = [
    dict(top_k=5),
    dict(top_p=0.7),
    dict(min_p=0.2),
    dict(typical_p=0.5),
    dict(top_k=12, typical_p=0.8, top_p=0.9, min_p=0.05),
    dict(top_p=0.6, min_p=0.1, temperature=0.5),
    dict(top_k=20, min_p=0.3),
    dict(typical_p=0.95, top_p=0.95, min_p=0.25),
    dict(typical_p=0.9, temperature=2.0),
]


@pytest.mark.parametrize("kw", FILTERS)
def test_candidates_equal_reference(kw):
    g = torch.Generator().manual_seed(7)
    full = SamplingParams()
    for _ in range(30):
        x = torch.randn(40, generator=g) * 2
        x[torch.randint(0, 40, (5,), generator=g)] = -INF  # some masked ids
        p = SamplingParams(**kw)
        ids, probs = candidates(x, p)
        want_ids, want_probs = ref_candidates(x.tolist(), p)
        assert ids.tolist() == want_ids
        assert torch.allclose(probs, torch.tensor(want_probs, dtype=torch.float32), atol=1e-6)
        assert len(want_ids) < len(ref_candidates(x.tolist(), full)[0])  # the filter cut


def test_top_k_ties_go_to_the_lower_id():
    x = torch.tensor([1.0, 3.0, 2.0, 0.0, 4.0, 3.0, 3.0])
    assert candidates(x, SamplingParams(top_k=2))[0].tolist() == [4, 1]
    assert candidates(x, SamplingParams(top_k=4))[0].tolist() == [4, 1, 5, 6]
    assert candidates(x, SamplingParams(top_k=10))[0].tolist() == [4, 1, 5, 6, 2, 0, 3]
    x[[0, 1, 2, 3, 5]] = -INF  # fewer finite ids than k: all of them, masked ones never
    assert candidates(x, SamplingParams(top_k=3))[0].tolist() == [4, 6]


def test_temperature_only_changes_the_final_distribution():
    x = torch.tensor([2.0, 1.0, 0.0, -1.0])
    for t in (0.5, 2.0):
        ids, probs = candidates(x, SamplingParams(temperature=t))
        assert ids.tolist() == [0, 1, 2, 3]
        assert torch.allclose(probs, (x / t).softmax(0), atol=1e-7)


def test_draw_inverts_the_cdf():
    ids = torch.tensor([7, 2, 9, 4])
    probs = torch.tensor([0.5, 0.25, 0.25, 0.0])
    for u, want in [(0.0, 7), (0.49, 7), (0.5, 2), (0.74, 2), (0.75, 9), (0.9999, 9)]:
        assert draw(ids, probs, u) == want


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_empirical_frequencies_match_temperature(temperature):
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    n = 5000
    got = _draws(logits, _row(seed=11, temperature=temperature), n)
    want = (logits / temperature).softmax(0).tolist()
    untempered = logits.softmax(0).tolist()
    for t, q in enumerate(want):
        tol = 5 * math.sqrt(q * (1 - q) / n) + 1e-3
        assert abs(got[t] / n - q) < tol
    assert abs(got[0] / n - untempered[0]) > 0.1  # ignoring the temperature would fail


@pytest.mark.parametrize(
    "kw, hits_expected, misses_expected",
    [
        (dict(), True, True),  # u past the head's mass falls back
        (dict(top_p=0.9), True, False),  # the cut lies inside the head
        (dict(top_p=0.999999), False, True),  # ... or past it
        (dict(min_p=0.1), True, False),
        (dict(min_p=1e-6), False, True),
    ],
)
def test_draw_from_head_equals_the_full_draw(kw, hits_expected, misses_expected):
    g = torch.Generator().manual_seed(2)
    p = SamplingParams(temperature=0.8, **kw)
    hits = misses = 0
    for _ in range(10):
        x = torch.randn(3000, generator=g) * 1.5
        x[torch.randperm(3000, generator=g)[:30]] += 9.0  # an LM-like peak: most mass in few ids
        ids, probs = candidates(x, p)
        for u in [*torch.rand(50, generator=g).tolist(), 0.0, 0.999999]:
            got = draw_from_head(x, p, u, 64)
            if got is None:
                misses += 1
            else:
                hits += 1
                assert got == draw(ids, probs, u)
    assert (hits > 0, misses > 0) == (hits_expected, misses_expected)


def test_sampler_uses_the_head_path_and_agrees(monkeypatch):
    monkeypatch.setattr(sampler_mod, "_HEAD", 16)
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(4, 500, generator=g) * 3
    rows = [_row(seed=i, temperature=0.9, top_p=0.95) for i in range(4)]
    got = [t.token_id for t in Sampler()(logits, rows)]
    want = []
    for i, row in enumerate(rows):
        again = _row(seed=i, temperature=0.9, top_p=0.95)
        u = float(torch.rand((), generator=again.rng))
        want.append(draw(*candidates(process(logits[i], row), row.params), u))
    assert got == want


# ---------------------------------------------------------------- seeds and batching


def test_exactly_one_uniform_per_sampled_row_and_none_for_greedy():
    logits = torch.randn(2, 50)
    a, greedy = _row(seed=5, top_k=3), _row(temperature=0)
    greedy.rng = torch.Generator().manual_seed(6)
    Sampler()(logits, [a, greedy])
    ref_a, ref_g = torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)
    torch.rand((), generator=ref_a)
    assert torch.rand(3, generator=a.rng).tolist() == torch.rand(3, generator=ref_a).tolist()
    assert torch.rand(3, generator=greedy.rng).tolist() == torch.rand(3, generator=ref_g).tolist()


NEIGHBOURS = [
    dict(temperature=0),
    dict(temperature=0.7, top_k=20),
    dict(temperature=1.2, top_p=0.8, repetition_penalty=1.2),
    dict(temperature=0, logit_bias={3: 2.0}),
    dict(temperature=0.9, min_p=0.1, typical_p=0.9, logprobs=3),
]


def _run(steps_logits: torch.Tensor, rows: list[SamplingRow], target: int) -> list[int]:
    s, seq = Sampler(), []
    for logits in steps_logits:
        out = s(logits[: len(rows)], rows)
        for r, o in zip(rows, out, strict=True):
            r.output_ids.append(o.token_id)
        seq.append(out[target].token_id)
    return seq


def test_seeded_row_is_independent_of_its_batch():
    g = torch.Generator().manual_seed(0)
    steps = torch.randn(50, 16, 300, generator=g)
    mk = lambda: _row(seed=42, temperature=0.8, top_p=0.9, frequency_penalty=0.3)
    alone = _run(steps[:, 7:8], [mk()], 0)
    others = [_row(seed=i, **NEIGHBOURS[i % len(NEIGHBOURS)]) for i in range(16)]
    others[7] = mk()
    crowded = _run(steps, others, 7)
    assert alone == crowded
    assert _run(steps[:, 7:8], [mk()], 0) == alone  # and across calls
    other_seed = _row(seed=43, temperature=0.8, top_p=0.9, frequency_penalty=0.3)
    assert _run(steps[:, 7:8], [other_seed], 0) != alone


def test_greedy_batch_path_equals_per_row_path(monkeypatch):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(16, 2000, generator=g)
    logits[5, 10] = logits[5, 1500] = 50.0  # a tie: the lower id wins
    rows = [_row(temperature=0) for _ in range(16)]
    per_row = [int(process(logits[i], r).argmax()) for i, r in enumerate(rows)]

    def no_processing(*a):
        raise AssertionError("trivial greedy rows must not be processed one by one")

    monkeypatch.setattr(sampler_mod, "process", no_processing)
    got = [t.token_id for t in Sampler()(logits, rows)]
    assert got == per_row == logits.argmax(-1).tolist()
    assert got[5] == 10


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_logits_give_the_host_tokens_and_logprobs():
    """Logits left on the GPU: greedy rows answered there (ties to the lower id), plain sampled
    rows drawn there (`device_sampling`), rows with processors sampled on the host from a copy:
    the same tokens as host logits, seeds included."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(8, 3000, generator=g)
    logits[2, 7] = logits[2, 2900] = 40.0
    greedy, sampled = {"temperature": 0.0}, {"temperature": 0.7, "top_p": 0.9}
    kinds = [greedy, sampled, greedy, {**greedy, "repetition_penalty": 1.3}] * 2

    def rows():
        return [_row(seed=i, output=[1, 2, 3], logprobs=2, **k) for i, k in enumerate(kinds)]

    host = Sampler()(logits, rows())
    dev = Sampler()(logits.cuda(), rows())
    assert [t.token_id for t in dev] == [t.token_id for t in host] and dev[2].token_id == 7
    for a, b in zip(dev, host, strict=True):
        assert a.rank == b.rank and abs(a.logprob - b.logprob) < 1e-5


def test_half_precision_logits_are_cast():
    logits = torch.randn(3, 100).to(torch.bfloat16)
    rows = [_row(temperature=0, logprobs=2) for _ in range(3)]
    out = Sampler()(logits, rows)
    lp = logits.float().log_softmax(-1)
    assert [o.token_id for o in out] == logits.float().argmax(-1).tolist()
    assert [o.logprob for o in out] == lp.max(-1).values.tolist()


# ---------------------------------------------------------------- logprobs


def _ref_rank(lp: list[float], t: int) -> int:
    order = sorted(range(len(lp)), key=lambda i: (-lp[i], i))
    return order.index(t) + 1


def test_sampled_logprobs_are_raw_and_ranked():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 30, generator=g)
    logits[1, 4] = logits[1, 8] = logits[1, 20] = 4.0  # ties ranked by id
    rows = [
        _row(seed=1, temperature=1.5, logprobs=5, logit_bias={2: 3.0}),
        _row(temperature=0, logprobs=3, banned_token_ids=(4,)),
        _row(temperature=0),
    ]
    out = Sampler()(logits, rows)
    lp = torch.log_softmax(logits, -1)
    for i in (0, 1):
        o, k, row_lp = out[i], rows[i].params.logprobs, lp[i].tolist()
        assert o.logprob == row_lp[o.token_id]  # before bias / bans: raw
        assert o.rank == _ref_rank(row_lp, o.token_id)
        want = sorted(range(30), key=lambda t: (-row_lp[t], t))[:k]
        assert o.top == [(t, row_lp[t]) for t in want]
    assert out[1].token_id == 8 and out[1].rank == 2
    assert [t for t, _ in out[1].top] == [4, 8, 20]
    assert out[2].logprob is None and out[2].top is None


def test_logprobs_zero_gives_only_the_chosen_token():
    out = _sample1(torch.tensor([0.0, 1.0, 2.0]), _row(temperature=0, logprobs=0))
    assert out.top == [] and out.rank == 1
    assert out.logprob == torch.log_softmax(torch.tensor([0.0, 1.0, 2.0]), 0)[2].item()


def test_prompt_logprobs_exact(monkeypatch):
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(6, 25, generator=g)
    logits[4] = 0.0  # all tied: ranks and the top k by id
    targets = [3, 0, 24, 7, 7, 11]
    got = prompt_logprobs(logits, targets, 4)
    lp = torch.log_softmax(logits, -1)
    for i, t in enumerate(targets):
        row = lp[i].tolist()
        best = sorted(range(25), key=lambda j: (-row[j], j))
        want = {t: (row[t], _ref_rank(row, t))} | {
            j: (row[j], r + 1) for r, j in enumerate(best[:4])
        }
        assert {k: (v.logprob, v.rank) for k, v in got[i].items()} == want
        assert next(iter(got[i])) == t  # the target is listed first
    assert list(got[4]) == [7, 0, 1, 2, 3] and got[4][7].rank == 8
    monkeypatch.setattr(sampler_mod, "_CHUNK_ELEMENTS", 50)  # two rows a chunk
    assert prompt_logprobs(logits, targets, 4) == got
    assert [list(d) for d in prompt_logprobs(logits, targets, 0)] == [[t] for t in targets]


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "logits, row, msg",
    [
        (torch.tensor([0.0, float("nan")]), _row(temperature=0), "NaN"),
        (torch.tensor([0.0, INF]), _row(seed=1), "NaN or \\+inf"),
        (torch.tensor([-INF, -INF]), _row(temperature=0), "-inf everywhere"),
        (torch.zeros(4), _row(seed=1, allowed_token_ids=(1, 2), banned_token_ids=(1, 2)), "masked"),
        (torch.zeros(4), _row(temperature=0, allowed=torch.zeros(4, dtype=torch.bool)), "masked"),
        (torch.zeros(4), _row(temperature=0, allowed=torch.ones(4)), "bool"),
        (torch.zeros(4), _row(temperature=0, logit_bias={4: 1.0}), "outside the vocabulary"),
        (torch.zeros(4), _row(seed=1, banned_token_ids=(9,)), "outside the vocabulary"),
    ],
)
def test_bad_rows_raise(logits, row, msg):
    with pytest.raises(ValueError, match=msg):
        _sample1(logits, row)


@pytest.mark.parametrize("bias", [1e39, 1e308, 100.5, -101.0, float("nan")])
def test_logit_bias_beyond_openais_range_is_refused(bias):
    # +-100 already forces or bans a token; 1e39 overflowed float32 logits to +inf (a 500
    # from the server before this check).
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={1: bias})


def test_bad_batches_raise():
    s = Sampler()
    with pytest.raises(ValueError, match="rows=2"):
        s(torch.zeros(3, 5), [_row(temperature=0)] * 2)
    with pytest.raises(ValueError):
        s(torch.zeros(5), [_row(temperature=0)])
    no_rng = _row(seed=1)
    no_rng.rng = None
    with pytest.raises(ValueError, match="generator"):
        s(torch.zeros(1, 5), [no_rng])
    with pytest.raises(ValueError, match="targets=2"):
        prompt_logprobs(torch.zeros(3, 5), [1, 2], 1)
    with pytest.raises(ValueError, match="outside"):
        prompt_logprobs(torch.zeros(2, 5), [1, 5], 1)
    with pytest.raises(ValueError, match="NaN"):
        prompt_logprobs(torch.tensor([[0.0, float("nan")]]), [0], 1)
