"""Choosing each step's codes: classifier-free guidance, then temperature, top-k and top-p (in
transformers' order and with its tie rules), then a draw from a seeded generator, or the argmax
when the temperature is 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_K = 1 << 20


@dataclass(frozen=True)
class SamplingOptions:
    """How codes are chosen. MusicGen's defaults: sampling at temperature 1 from the top 250
    codes, guidance scale 3."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = 250  # 0 = off
    top_p: float = 1.0  # 1 = off
    guidance_scale: float = 3.0  # <= 1 = off (no unconditional row)
    seed: int | None = None

    def check(self) -> None:
        if not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature must be between 0 and 100, got {self.temperature}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.guidance_scale <= 100:
            raise ValueError(f"guidance_scale must be between 0 and 100, got {self.guidance_scale}")

    @property
    def cfg(self) -> bool:
        return self.guidance_scale > 1


def guide(logits: torch.Tensor, scale: float) -> torch.Tensor:
    """(2, ...) conditional and unconditional logits to the guided (...) logits."""
    cond, uncond = logits[0], logits[1]
    return uncond + (cond - uncond) * scale


def warp(logits: torch.Tensor, opts: SamplingOptions) -> torch.Tensor:
    """Temperature, top-k, then top-p over the last dim; dropped codes get -inf."""
    x = logits / opts.temperature if opts.temperature != 1 else logits
    if opts.top_k and opts.top_k < x.shape[-1]:
        kth = torch.topk(x, opts.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))  # ties with the k-th stay in
    if opts.top_p < 1:
        sorted_x, order = torch.sort(x, descending=False, dim=-1)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop = cum <= 1 - opts.top_p
        drop[..., -1:] = False  # the top code always stays
        x = x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return x


def choose(
    logits: torch.Tensor, opts: SamplingOptions, gen: torch.Generator | None
) -> torch.Tensor:
    """One code per row of (rows, vocab) guided logits."""
    if opts.temperature == 0:
        return logits.argmax(-1)
    probs = warp(logits.float(), opts).softmax(-1)
    return torch.multinomial(probs, 1, generator=gen)[:, 0]
