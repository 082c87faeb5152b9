"""Compare an engine's next-token distributions with the recorded llama.cpp goldens (numpy only).

The goldens (``tests/data/goldens/<model>.json``, written by ``record_llamacpp_goldens.py``) hold
llama.cpp's *truncated* distributions: the top-K log-probabilities at each position plus the log of
the probability mass outside the top-K. This module turns an engine's full logits into the figures
used by the tests and by ``record_transformers_figures.py``:

``load_golden(path)``
    Read a golden ``.json`` or ``.json.gz``.
``teacher_forced_metrics(golden, source)``
    Teacher-forced comparison over ``golden["teacher_forced"]``: top-1 agreement with llama.cpp's
    argmax, mean KL(P_llama || Q_ours) (top-K + tail estimate, see below), both perplexities.
    ``source`` is an ``(N, V)`` array of logits (or log-probs) for positions ``0..N-1`` of
    ``token_ids`` (extra trailing rows are ignored), an iterable of such row blocks (streaming, to
    avoid materialising ``N x 262144`` floats), or a callable ``fn(token_ids)`` returning either.
``greedy_prefix_report(prompt, our_ids)`` / ``greedy_report(golden, generate_fn)``
    How many greedy tokens match llama.cpp's before the first divergence, and at the divergence the
    gap in llama.cpp's log-probs between its choice and ours.
``greedy_teacher_forced_report(prompt, rows)`` / ``greedy_sequence(prompt)``
    Teacher-force llama.cpp's greedy sequence and compare, at each step, our log-probs on
    llama.cpp's top-10 ids (the robust check: it never requires long greedy equality).

KL estimator. With P (llama.cpp) known only on its top-K set S and as a tail mass
``p_tail = 1 - sum_S p``::

    KL(P || Q) ~= sum_{i in S} p_i (log p_i - log q_i) + p_tail (log p_tail - log q_tail)

where ``q_tail = Q(V \\ S)`` is computed exactly from our full distribution. This is the KL between
the two distributions coarsened to S + {tail}; by the data-processing inequality it is a lower
bound of the exact KL, and with K=64 it misses very little (the tail mass is small at nearly
every position). Logprobs in the goldens are rounded to 5 decimals, so estimates below ~1e-5 are
noise and can even be slightly negative.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

__all__ = [
    "TeacherForcedAccumulator",
    "greedy_prefix_report",
    "greedy_report",
    "greedy_sequence",
    "greedy_teacher_forced_report",
    "load_golden",
    "log_softmax",
    "teacher_forced_metrics",
]


def load_golden(path: str | Path) -> dict:
    """Load a golden file (``.json`` or ``.json.gz``)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64 (idempotent: log-probs in give the same log-probs out)."""
    x = np.asarray(x, dtype=np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    z = x - m
    return z - np.log(np.sum(np.exp(z), axis=-1, keepdims=True))


def _logsumexp(x: np.ndarray) -> float:
    if x.size == 0:
        return -math.inf
    m = float(np.max(x))
    if m == -math.inf:
        return -math.inf
    return m + math.log(float(np.sum(np.exp(x - m))))


class TeacherForcedAccumulator:
    """Streaming version of :func:`teacher_forced_metrics`: ``add(rows)`` blocks in order, then
    ``result()``. Rows are logits (or log-probs) for consecutive positions starting at 0."""

    def __init__(self, golden: dict):
        tf = golden["teacher_forced"]
        self.ids = np.asarray(tf["token_ids"], dtype=np.int64)
        self.n = len(self.ids) - 1
        self.ref_argmax = np.asarray(tf["argmax_ids"], dtype=np.int64)
        self.ref_next = np.asarray(tf["next_logprob"], dtype=np.float64)
        self.topk_ids = tf["topk_ids"]
        self.topk_lp = tf["topk_logprobs"]
        self.log_tail = tf["log_tail_mass"]
        self.t = 0
        self.kl = np.zeros(self.n)
        self.nll = np.zeros(self.n)
        self.argmax = np.zeros(self.n, dtype=np.int64)
        self.gap_at_disagreement: list[tuple[int, float, bool]] = []

    def add(self, rows: np.ndarray) -> None:
        rows = np.asarray(rows)
        if rows.ndim == 1:
            rows = rows[None, :]
        rows = rows[: max(0, self.n - self.t)]  # ignore rows past the last predicting position
        for start in range(0, len(rows), 64):  # bound float64 temporaries (64 x V)
            lp_block = log_softmax(rows[start : start + 64])
            for lp in lp_block:
                self._add_row(lp)

    def _add_row(self, lp: np.ndarray) -> None:
        t = self.t
        ids = np.asarray(self.topk_ids[t], dtype=np.int64)
        p_lp = np.asarray(self.topk_lp[t], dtype=np.float64)
        q_lp = lp[ids]
        mask = np.ones(lp.shape[0], dtype=bool)
        mask[ids] = False
        log_q_tail = _logsumexp(lp[mask])
        log_p_tail = float(self.log_tail[t])
        kl = float(np.sum(np.exp(p_lp) * (p_lp - q_lp)))
        if log_p_tail > -math.inf:
            p_tail = math.exp(log_p_tail)
            kl += p_tail * (log_p_tail - max(log_q_tail, -745.0))
        self.kl[t] = kl
        self.nll[t] = -lp[self.ids[t + 1]]
        ours = int(np.argmax(lp))
        self.argmax[t] = ours
        ref = int(self.ref_argmax[t])
        if ours != ref:
            hit = np.nonzero(ids == ours)[0]
            if hit.size:  # exact gap in llama.cpp's log-probs between its choice and ours
                self.gap_at_disagreement.append((t, float(p_lp[0] - p_lp[hit[0]]), True))
            else:  # ours is outside llama.cpp's top-K: the gap is at least this
                self.gap_at_disagreement.append((t, float(p_lp[0] - p_lp[-1]), False))
        self.t += 1

    def result(self) -> dict:
        if self.t != self.n:
            raise ValueError(f"got {self.t} rows, need {self.n} (one per predicting position)")
        agree = self.argmax == self.ref_argmax
        gaps = [g for _, g, _ in self.gap_at_disagreement]
        dnext = np.abs(-self.nll - self.ref_next)
        return {
            "n_positions": int(self.n),
            "top1_agreement": float(np.mean(agree)),
            "n_top1_disagree": int(np.sum(~agree)),
            "disagree_positions": [t for t, _, _ in self.gap_at_disagreement],
            "max_ref_gap_at_disagreement": max(gaps) if gaps else 0.0,
            "disagreements_outside_ref_topk": sum(
                1 for *_, exact in self.gap_at_disagreement if not exact
            ),
            "mean_kl": float(np.mean(self.kl)),
            "median_kl": float(np.median(self.kl)),
            "p99_kl": float(np.percentile(self.kl, 99)),
            "max_kl": float(np.max(self.kl)),
            "max_kl_position": int(np.argmax(self.kl)),
            "mean_nll_ours": float(np.mean(self.nll)),
            "mean_nll_ref": float(-np.mean(self.ref_next)),
            "ppl_ours": float(np.exp(np.mean(self.nll))),
            "ppl_ref": float(np.exp(-np.mean(self.ref_next))),
            "mean_abs_next_logprob_diff": float(np.mean(dnext)),
            "max_abs_next_logprob_diff": float(np.max(dnext)),
        }


def teacher_forced_metrics(golden: dict, source) -> dict:
    """Teacher-forced figures of an engine against ``golden["teacher_forced"]``.

    ``source``: ``(N, V)`` logits/log-probs array, an iterable of row blocks, or a callable
    ``fn(token_ids: list[int])`` returning one of those. Row ``t`` is the distribution after
    ``token_ids[: t + 1]`` (predicting ``token_ids[t + 1]``). Returns a dict with
    ``top1_agreement``, ``mean_kl`` (top-K + tail estimate of KL(P_llama || Q_ours)), ``ppl_ours``,
    ``ppl_ref`` and more (see :meth:`TeacherForcedAccumulator.result`).
    """
    if callable(source):
        source = source(list(golden["teacher_forced"]["token_ids"]))
    acc = TeacherForcedAccumulator(golden)
    if isinstance(source, np.ndarray) or hasattr(source, "shape"):
        acc.add(np.asarray(source))
    else:
        for block in source:
            acc.add(np.asarray(block))
    return acc.result()


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if int(x) != int(y):
            break
        n += 1
    return n


def greedy_prefix_report(prompt: dict, our_ids: Sequence[int]) -> dict:
    """Compare our greedy continuation with llama.cpp's for one golden prompt.

    ``our_ids`` must be produced the same way as the golden: greedy, at most
    ``len(prompt["generated_ids"])`` tokens unless llama.cpp stopped at an EOG token, stopping after
    an EOG token (included). Returns ``n_match`` (tokens equal before the first divergence),
    ``full_match`` and, on divergence, ``ref_choice``, ``our_choice`` and ``ref_logprob_gap``
    (llama.cpp's log-prob of its choice minus that of ours; ``gap_exact`` False means ours is not in
    llama.cpp's top-10 and the gap is a lower bound).
    """
    ref = list(prompt["generated_ids"])
    ours = [int(x) for x in our_ids]
    n = _common_prefix(ref, ours)
    out = {
        "name": prompt["name"],
        "n_ref": len(ref),
        "n_ours": len(ours),
        "n_match": n,
        "full_match": n == len(ref) == len(ours),
    }
    if n < len(ref) and n < len(ours):
        top_ids, top_lp = prompt["top_ids"][n], prompt["top_logprobs"][n]
        chosen_lp = prompt["chosen_logprobs"][n]
        out.update(diverged_at=n, ref_choice=ref[n], our_choice=ours[n])
        if ours[n] in top_ids:
            out.update(ref_logprob_gap=chosen_lp - top_lp[top_ids.index(ours[n])], gap_exact=True)
        else:
            out.update(ref_logprob_gap=chosen_lp - top_lp[-1], gap_exact=False)
    elif not out["full_match"]:
        out["diverged_at"] = n  # one sequence is a prefix of the other (EOG/length mismatch)
    return out


def greedy_report(
    golden: dict, generate_fn: Callable[[list[int], int, set[int]], Sequence[int]]
) -> dict:
    """Run ``generate_fn(prompt_ids, n_predict, eog_ids)`` on every golden prompt and summarise
    :func:`greedy_prefix_report` (``per_prompt``, ``n_full_match``, ``mean_match_fraction``)."""
    eog = set(golden["model"]["eog_ids"])
    n_predict = golden["greedy"]["n_predict"]
    per = [
        greedy_prefix_report(p, generate_fn(list(p["prompt_ids"]), n_predict, eog))
        for p in golden["greedy"]["prompts"]
    ]
    return {
        "per_prompt": per,
        "n_prompts": len(per),
        "n_full_match": sum(r["full_match"] for r in per),
        "mean_match_fraction": float(np.mean([r["n_match"] / max(1, r["n_ref"]) for r in per])),
    }


def greedy_sequence(prompt: dict) -> tuple[list[int], int, int]:
    """Token sequence to teacher-force llama.cpp's greedy run.

    Returns ``(ids, first_row, n_rows)``: rows ``first_row .. first_row + n_rows - 1`` of a forward
    pass over ``ids`` are the distributions of the generation steps (feed them to
    :func:`greedy_teacher_forced_report`)."""
    p, g = list(prompt["prompt_ids"]), list(prompt["generated_ids"])
    return p + g[:-1], len(p) - 1, len(g)


def greedy_teacher_forced_report(prompt: dict, rows: np.ndarray) -> dict:
    """Compare our distributions at llama.cpp's greedy steps (``rows``: ``(n_steps, V)`` logits or
    log-probs, see :func:`greedy_sequence`) with the golden top-10 log-probs.

    Returns per-prompt figures: ``n_argmax_agree``, ``first_disagree_step``,
    ``max_ref_token_margin`` (max over steps of our top-1 log-prob minus our log-prob of
    llama.cpp's token: 0 when we agree), ``max_abs_top10_diff`` / ``mean_abs_top10_diff`` (|our
    log-prob - llama.cpp's| over llama.cpp's top-10 ids), ``first_step_top1_match``.
    """
    lp = log_softmax(rows)
    gen = prompt["generated_ids"]
    if lp.shape[0] != len(gen):
        raise ValueError(f"need {len(gen)} rows, got {lp.shape[0]}")
    agree, margins, diffs = [], [], []
    for s, tok in enumerate(gen):
        ours = lp[s]
        agree.append(int(np.argmax(ours)) == tok)
        margins.append(float(np.max(ours) - ours[tok]))
        ids = np.asarray(prompt["top_ids"][s])
        diffs.append(np.abs(ours[ids] - np.asarray(prompt["top_logprobs"][s])))
    diffs = np.concatenate(diffs) if diffs else np.zeros(0)
    first = next((i for i, a in enumerate(agree) if not a), None)
    return {
        "name": prompt["name"],
        "n_steps": len(gen),
        "n_argmax_agree": int(sum(agree)),
        "first_disagree_step": first,
        "first_step_top1_match": bool(agree[0]) if agree else True,
        "max_ref_token_margin": max(margins) if margins else 0.0,
        "max_abs_top10_diff": float(np.max(diffs)) if diffs.size else 0.0,
        "mean_abs_top10_diff": float(np.mean(diffs)) if diffs.size else 0.0,
    }
