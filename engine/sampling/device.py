"""Sampled rows drawn on the logits' device, with no host sync: what a GPU decode step needs to
launch the next step before its tokens reach the host (`engine.runtime.decode_ahead`).

Rows qualify when temperature, top_k, top_p and min_p are their only controls (no bias, masks,
penalties, grammar, min_tokens or typical_p: those stay on the host sampler). The draw is the
host sampler's (`sampler.candidates` + `sampler.draw`): the row sorted by probability, ties by id
(one stable sort), top_k, then top_p over the kept candidates, min_p on the untempered logits,
temperature, and one uniform from the request's generator inverting the CDF. Only the float
rounding of the sums differs from the host's, so a draw within rounding of a CDF step may differ.
"""

import math
from dataclasses import dataclass

import torch

from localllm.engine.sampling.params import SamplingParams


@dataclass(slots=True)
class DeviceDraw:
    """The sampled rows of one step: which rows, their controls, their uniforms (drawn from the
    requests' generators, whose states before the draw are kept so a dropped step can put
    them back)."""

    rows: list[int]
    params: list[SamplingParams]
    u: list[float]
    states: list[tuple[torch.Generator, torch.Tensor]]

    @classmethod
    def draw(cls, rows: list[int], params: list[SamplingParams], rngs: list[torch.Generator]):
        states = [(g, g.get_state()) for g in rngs]
        u = [float(torch.rand((), generator=g)) for g in rngs]  # one uniform per row, as the host
        return cls(rows, params, u, states)

    def restore(self) -> None:
        """The generators as they were before this draw (its step was never used)."""
        for g, state in self.states:
            g.set_state(state)


def tokens(logits: torch.Tensor, draw: DeviceDraw | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's maximum (for validation) and token: the argmax, or the draw's sample in its
    rows; both stay on the logits' device."""
    x = logits.detach().float()
    best, ids = x.max(-1)
    if draw is None or not draw.rows:
        return best, ids
    ctl = _controls(draw.params, draw.u, x.shape[1], draw.rows, x.device)
    if draw.rows == list(range(x.shape[0])):  # every row drawn (the common case): no gathers
        return best, _sample(x, ctl, draw.params)
    rows = ctl[5].long()
    return best, ids.index_copy(0, rows, _sample(x.index_select(0, rows), ctl, draw.params))


def sample(x: torch.Tensor, params: list[SamplingParams], u: list[float]) -> torch.Tensor:
    """One token per row of x [n, V] (float32) under its params, at its uniform."""
    rows = list(range(x.shape[0]))
    return _sample(x, _controls(params, u, x.shape[1], rows, x.device), params)


def _controls(params, u, vocab: int, rows, device) -> torch.Tensor:
    """The rows' controls as one [6, n] tensor on `device` (one copy): top_k (the vocabulary when
    off), top_p (2 when off: every cumulative mass is below it), log(min_p) (-inf when off),
    temperature, uniform, row index."""
    t = torch.tensor(
        [
            [p.top_k if p.top_k and p.top_k < vocab else vocab for p in params],
            [p.top_p if p.top_p < 1.0 else 2.0 for p in params],
            [math.log(p.min_p) if p.min_p > 0.0 else -math.inf for p in params],
            [p.temperature for p in params],
            u,
            rows,
        ],
        dtype=torch.float32,
    )
    return _to(t, device)


def _sample(x: torch.Tensor, ctl: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    # Few ops, as each is a launch the host makes every token. Masked (-inf) ids need no mask of
    # their own: their probability is 0 in every sum below and a draw never lands on one.
    vocab = x.shape[1]
    vals, ids = x.sort(dim=-1, descending=True, stable=True)  # probability order, ties by id
    col = torch.arange(vocab, device=x.device)
    top_k, top_p, floor, temp, u = (c[:, None] for c in ctl[:5])
    keep = col < top_k
    if any(p.top_p < 1.0 for p in params):
        cum = torch.where(keep, vals, -math.inf).softmax(-1).cumsum(-1)
        keep &= col <= (cum < top_p).sum(-1, keepdim=True)
    if any(p.min_p > 0.0 for p in params):
        keep &= vals >= vals[:, :1] + floor
    probs = torch.where(keep, (vals - vals[:, :1]) / temp, -math.inf).softmax(-1)
    cdf = probs.cumsum(-1)
    pos = (cdf <= cdf[:, -1:] * u).sum(-1)
    last = probs.count_nonzero(-1) - 1  # never a zero-probability id
    # a row with no finite maximum (NaN, +inf, all -inf) still indexes inside the row: the host
    # rejects it from the maxima (`sampler.check_maxima`), never a device-side fault
    at = torch.minimum(pos, last).clamp(0, vocab - 1)
    return ids.gather(1, at[:, None])[:, 0]


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor onto `device` without a host sync (page-locked, asynchronous)."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)
