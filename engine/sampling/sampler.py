"""The engine's sampler: one call turns a [R, V] logits batch into one token per row, each row under
its own request's controls, plus raw logprobs; and `prompt_logprobs` for scoring prompt tokens.

Per row: logit_bias -> allowed/banned/grammar masks -> min_tokens -> repetition penalty ->
presence/frequency penalties -> argmax (temperature 0) or llama.cpp's chain top_k -> typical_p ->
top_p -> min_p (untempered) -> temperature -> one uniform from the request's generator inverts the
CDF of the candidates sorted by probability (ties by id), so a seeded request draws the same
tokens whatever its batch. Rows with nothing to do (greedy, no processors) share one argmax, on
the logits' device: from a GPU only the rows' maxima and argmax cross to the host (one copy of
2 x rows values); a GPU draws rows whose only controls are temperature, top_k, top_p and min_p
itself (`engine.sampling.device`, the same draw); rows with processors are copied and sampled on
the host.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from localllm.engine.core.outputs import Logprob
from localllm.engine.sampling.device import DeviceDraw
from localllm.engine.sampling.device import tokens as device_tokens
from localllm.engine.sampling.params import SamplingParams

_NEG_INF = float("-inf")
_CHUNK_ELEMENTS = 1 << 24  # prompt_logprobs works on at most this many logits at a time (64 MiB)
# Sampling without top_k first tries the best _HEAD ids, which hold nearly all the mass of an LM
# distribution, so a draw rarely sorts the whole vocabulary (slow on CPU for 262k ids).
_HEAD = 1024
_EXACT_IDS = 1 << 24  # token ids a float32 holds exactly (the argmax rides with the maxima)


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    rng: torch.Generator | None  # the request's own generator (None when greedy)
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]  # generated so far (penalties; min_tokens counts it)
    eos_ids: frozenset[int]  # end-of-generation ids, banned with stop_token_ids under min_tokens
    allowed: torch.Tensor | None = (
        None  # bool [vocab] from a grammar matcher, True = may be sampled
    )


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None  # the chosen token's raw logprob, when params.logprobs is set
    rank: int | None = None  # its rank (1 = most likely)
    top: list[tuple[int, float]] | None = None  # the params.logprobs most likely, best first


def _min_tokens_active(row: SamplingRow) -> bool:
    p = row.params
    return len(row.output_ids) < p.min_tokens and bool(row.eos_ids or p.stop_token_ids)


def _processors(row: SamplingRow) -> bool:
    """Whether any logits processor applies to the row."""
    p = row.params
    return (
        bool(p.logit_bias)
        or p.allowed_token_ids is not None
        or bool(p.banned_token_ids)
        or row.allowed is not None
        or _min_tokens_active(row)
        or p.repetition_penalty != 1.0
        or p.presence_penalty != 0.0
        or p.frequency_penalty != 0.0
    )


def needs_processing(row: SamplingRow) -> bool:
    """False for rows the batched argmax can answer: greedy with no logits processor."""
    return not row.params.greedy or _processors(row)


def drawn_on_device(row: SamplingRow) -> bool:
    """Sampled rows a GPU draws itself (`engine.sampling.device`): temperature, top_k, top_p and
    min_p their only controls."""
    p = row.params
    return not p.greedy and row.rng is not None and p.typical_p == 1.0 and not _processors(row)


def _ids(ids: Sequence[int], vocab: int, name: str, device: torch.device) -> torch.Tensor:
    t = torch.tensor(list(ids), dtype=torch.long)
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab):
        bad = next(i for i in ids if not 0 <= i < vocab)
        raise ValueError(f"{name}: token id {bad} is outside the vocabulary (0..{vocab - 1})")
    return t.to(device)


def _seen(ids: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    # History ids past the row cannot be sampled, so penalizing them is moot: drop them.
    t = torch.as_tensor(list(ids), dtype=torch.long)
    return t[(t >= 0) & (t < vocab)].to(device)


def _grammar_mask(allowed: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    if allowed.dtype != torch.bool or allowed.dim() != 1:
        raise ValueError(
            f"grammar mask must be a 1-D bool tensor, got {allowed.dtype} {allowed.dim()}D"
        )
    allowed = allowed.to(device)[:vocab]
    if allowed.shape[0] < vocab:  # ids past the grammar's vocabulary are not tokens it can accept
        allowed = torch.cat([allowed, allowed.new_zeros(vocab - allowed.shape[0])])
    return allowed


def process(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """One row's logits after bias, masks, min_tokens and penalties (a new float32 tensor)."""
    p = row.params
    x = logits.detach().to(torch.float32, copy=True)
    vocab, dev = x.shape[0], x.device
    if p.logit_bias:
        ids = _ids(list(p.logit_bias), vocab, "logit_bias", dev)
        x[ids] += torch.tensor(list(p.logit_bias.values()), dtype=torch.float32, device=dev)
    if p.allowed_token_ids is not None:
        keep = torch.zeros(vocab, dtype=torch.bool, device=dev)
        keep[_ids(p.allowed_token_ids, vocab, "allowed_token_ids", dev)] = True
        x.masked_fill_(~keep, _NEG_INF)
    if p.banned_token_ids:
        x[_ids(p.banned_token_ids, vocab, "banned_token_ids", dev)] = _NEG_INF
    if row.allowed is not None:
        x.masked_fill_(~_grammar_mask(row.allowed, vocab, dev), _NEG_INF)
    if _min_tokens_active(row):
        x[_seen([*row.eos_ids, *p.stop_token_ids], vocab, dev)] = _NEG_INF
    if p.repetition_penalty != 1.0:
        seen = torch.unique(_seen([*row.prompt_ids, *row.output_ids], vocab, dev))
        v = x[seen]
        x[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and row.output_ids:
        ids, counts = torch.unique(_seen(row.output_ids, vocab, dev), return_counts=True)
        x[ids] -= p.presence_penalty + p.frequency_penalty * counts.to(torch.float32)
    top = float(x.max())
    if math.isnan(top) or top == math.inf:
        raise ValueError("logits became NaN or +inf after logit_bias / penalties")
    if top == _NEG_INF:
        raise ValueError(
            "every token is masked for this request: allowed_token_ids, banned_token_ids, the "
            "grammar and min_tokens leave nothing to sample"
        )
    return x


def _best(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to k best finite entries of x [V] as (values, ids), best first, ties by lower id."""
    vals, ids = x.topk(k)
    if int((x >= vals[-1]).sum()) == k:  # no tie across the cut, none -inf: order the k only
        ids, order = ids.sort()
        vals, order = vals[order].sort(descending=True, stable=True)
        return vals, ids[order]
    # topk's choice among equal values is unspecified: take all of them, keep the lowest ids.
    cand = (x >= vals[-1].clamp(min=torch.finfo(torch.float32).min)).nonzero().flatten()
    vals, order = x[cand].sort(descending=True, stable=True)
    return vals[:k], cand[order[:k]]


def _top_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row of x [N, V] as (values, ids), best first, ties by lower id."""
    vals, ids = x.topk(k, dim=-1)
    ids, order = ids.sort(dim=-1)
    vals, order = vals.gather(-1, order).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(-1, order)
    for r in ((x >= vals[:, -1:]).sum(-1) > k).nonzero().flatten().tolist():
        cand = (x[r] >= vals[r, -1]).nonzero().flatten()  # a tie across the cut: lowest ids win
        v, o = x[r, cand].sort(descending=True, stable=True)
        vals[r], ids[r] = v[:k], cand[o[:k]]
    return vals, ids


def candidates(x: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The final (ids, probs) a processed row draws from, in draw order (probability descending,
    ties by id): top_k, typical_p, top_p, min_p on the untempered logits, then temperature."""
    if p.top_k and p.top_k < x.shape[0]:
        vals, ids = _best(x, p.top_k)
    else:
        ids = (x > _NEG_INF).nonzero().flatten()
        vals = x[ids]
        if p.min_p > 0.0 and p.typical_p == 1.0 and p.top_p == 1.0:  # min_p alone: cut first
            keep = vals >= vals.max() + math.log(p.min_p)
            ids, vals = ids[keep], vals[keep]
        vals, order = vals.sort(descending=True, stable=True)
        ids = ids[order]
    if p.typical_p < 1.0:
        logp = vals.log_softmax(0)
        probs = logp.exp()
        entropy = -(probs * logp).sum()
        order = (-logp - entropy).abs().argsort(stable=True)
        cum = probs[order].cumsum(0)
        n = min(int((cum < p.typical_p).sum()) + 1, vals.shape[0])
        keep = order[:n].sort().values  # back to probability order
        vals, ids = vals[keep], ids[keep]
    if p.top_p < 1.0:
        cum = vals.softmax(0).cumsum(0)
        n = min(int((cum < p.top_p).sum()) + 1, vals.shape[0])
        vals, ids = vals[:n], ids[:n]
    if p.min_p > 0.0:
        n = int((vals >= vals[0] + math.log(p.min_p)).sum())
        vals, ids = vals[:n], ids[:n]
    # Shift by the max first so a tiny temperature cannot overflow to inf.
    return ids, ((vals - vals[0]) / p.temperature).softmax(0)


def draw(ids: torch.Tensor, probs: torch.Tensor, u: float) -> int:
    """Inverts the CDF of probs (in the given order) at u in [0, 1); never picks a zero-prob id."""
    cdf = probs.cumsum(0)
    pos = (cdf <= cdf[-1] * u).sum()
    last = (probs > 0).sum() - 1
    return int(ids[torch.minimum(pos, last)])


def draw_from_head(x: torch.Tensor, p: SamplingParams, u: float, head: int) -> int | None:
    """`draw(*candidates(x, p), u)` without sorting the vocabulary, for rows with no top_k and
    no typical_p: works on the `head` best ids and gives None when the answer lies past them."""
    vals, ids = _best(x, head)
    n, whole = vals.shape[0], vals.shape[0] < head  # whole: the head holds every finite id
    if p.top_p < 1.0:
        cut = int(((vals - x.logsumexp(0)).exp().cumsum(0) < p.top_p).sum()) + 1
        if cut > n and not whole:
            return None
        n, whole = min(cut, n), True
    if p.min_p > 0.0:
        thr = vals[0] + math.log(p.min_p)
        inside = int((vals[:n] >= thr).sum())
        if inside == n and not whole and int((x >= thr).sum()) > n:
            return None
        n, whole = inside, True
    vals, ids = vals[:n], ids[:n]
    if whole:
        return draw(ids, ((vals - vals[0]) / p.temperature).softmax(0), u)
    # The candidates run past the head: the draw is ours only if u lands inside it.
    total = ((x - vals[0]) / p.temperature).exp().sum()
    pos = int((((vals - vals[0]) / p.temperature).exp().cumsum(0) <= total * u).sum())
    return int(ids[pos]) if pos < n else None


def _logprob_rows(
    logits: torch.Tensor, targets: torch.Tensor, k: int
) -> tuple[list[float], list[int], list[list[float]], list[list[int]]]:
    """Raw logprob and rank of targets[i] under row i, and each row's top k (ties by id)."""
    lp = logits.float().log_softmax(-1)
    t = lp.gather(-1, targets[:, None])
    ar = torch.arange(lp.shape[1], device=lp.device)
    rank = (lp > t).sum(-1) + ((lp == t) & (ar < targets[:, None])).sum(-1) + 1
    if k:
        vals, ids = _top_rows(lp, min(k, lp.shape[1]))
        top_v, top_i = vals.tolist(), ids.tolist()
    else:
        top_v = top_i = [[] for _ in range(lp.shape[0])]
    return t[:, 0].tolist(), rank.tolist(), top_v, top_i


def check_maxima(maxima: Sequence[float]) -> None:
    """Rows whose maximum is NaN, +inf or -inf have no token to give: a clear error."""
    for i, m in enumerate(maxima):
        if math.isnan(m) or m == math.inf:
            raise ValueError(f"logits row {i} contains NaN or +inf")
        if m == _NEG_INF:
            raise ValueError(f"logits row {i} is -inf everywhere: nothing to sample")


class Sampler:
    """Samples one token per logits row under that row's own request controls."""

    def __init__(self, device_draws: bool | None = None):
        # plain sampled rows drawn by `device_sampling` (None: where the logits are on a GPU; a
        # CPU draws them faster from the best ids alone, `draw_from_head`)
        self.device_draws = device_draws

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledToken]:
        if logits.dim() != 2 or logits.shape[0] != len(rows) or logits.shape[1] == 0:
            raise ValueError(
                f"logits must be [rows={len(rows)}, vocab>0], got {tuple(logits.shape)}"
            )
        logits = logits.detach().float()
        draw = None
        on_device = self.device_draws
        if on_device is None:
            on_device = logits.device.type == "cuda"
        if on_device:  # plain sampled rows drawn there, in the same copy
            on = [i for i, r in enumerate(rows) if drawn_on_device(r)]
            ps, gens = [rows[i].params for i in on], [rows[i].rng for i in on]
            draw = DeviceDraw.draw(on, ps, gens) if on else None
        # every row's max (validation) and its token: the argmax, or the device's draw
        best, greedy = device_tokens(logits, draw)
        if logits.shape[1] <= _EXACT_IDS:  # one small copy from a device: maxima and ids together
            host = torch.stack((best, greedy.to(best.dtype))).cpu().tolist()
            maxima, chosen = host[0], [int(t) for t in host[1]]
        else:
            maxima, chosen = best.tolist(), greedy.tolist()
        check_maxima(maxima)
        drawn = set(draw.rows) if draw is not None else set()
        for i, row in enumerate(rows):
            if needs_processing(row) and i not in drawn:  # on the host, from any device
                chosen[i] = self._sample_row(logits[i].cpu(), row)
        out = [SampledToken(t) for t in chosen]
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if want:
            idx = torch.tensor(want, device=logits.device)
            k = max(rows[i].params.logprobs or 0 for i in want)
            lps, ranks, top_v, top_i = _logprob_rows(
                logits.index_select(0, idx), torch.tensor(chosen, device=logits.device)[idx], k
            )
            for j, i in enumerate(want):
                n = rows[i].params.logprobs or 0
                out[i].logprob, out[i].rank = lps[j], ranks[j]
                out[i].top = list(zip(top_i[j][:n], top_v[j][:n], strict=True))
        return out

    @staticmethod
    def _sample_row(logits: torch.Tensor, row: SamplingRow) -> int:
        p = row.params
        if p.greedy:
            return int(process(logits, row).argmax())  # first maximum: ties go to the lower id
        if row.rng is None:
            raise ValueError("a sampled (temperature > 0) row needs its request's generator")
        u = float(torch.rand((), generator=row.rng))  # exactly one uniform per sampled row
        x = process(logits, row)
        if not p.top_k and p.typical_p == 1.0 and x.shape[0] > 4 * _HEAD:
            token = draw_from_head(x, p, u, _HEAD)
            if token is not None:
                return token
        return draw(*candidates(x, p), u)


def prompt_logprobs(
    logits: torch.Tensor, targets: Sequence[int], k: int
) -> list[dict[int, Logprob]]:
    """Row i of logits predicts targets[i]: the target's raw logprob and rank plus the top k."""
    if logits.dim() != 2 or logits.shape[0] != len(targets) or logits.shape[1] == 0:
        raise ValueError(
            f"logits must be [targets={len(targets)}, vocab>0], got {tuple(logits.shape)}"
        )
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    vocab = logits.shape[1]
    tgt = _ids(targets, vocab, "prompt_logprobs target", logits.device)
    step = max(1, _CHUNK_ELEMENTS // vocab)
    out: list[dict[int, Logprob]] = []
    for s in range(0, len(targets), step):
        chunk = logits[s : s + step].detach().float()
        if torch.isnan(chunk).any() or torch.isposinf(chunk).any():
            raise ValueError("prompt logits contain NaN or +inf")
        lps, ranks, top_v, top_i = _logprob_rows(chunk, tgt[s : s + step], k)
        for j, t in enumerate(targets[s : s + step]):
            d = {t: Logprob(lps[j], ranks[j])}  # the target first, as vLLM lists it
            for r, (tid, v) in enumerate(zip(top_i[j], top_v[j], strict=True)):
                d.setdefault(tid, Logprob(v, r + 1))
            out.append(d)
    return out
