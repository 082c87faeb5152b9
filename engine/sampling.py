"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, min-p, seed.

Filters run in llama.cpp's order (top-k -> top-p -> min-p on the untempered distribution, then
temperature), so `localllm run` behaves like `llama-cli` with the same flags.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.8  # 0 means greedy (argmax)
    top_k: int = 40  # 0 disables
    top_p: float = 0.95  # 1.0 disables
    min_p: float = 0.05  # 0.0 disables
    seed: int | None = None  # None: nondeterministic
    max_tokens: int = 256
    ignore_eos: bool = False

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    """Turns one logits row into a token id under fixed params (holds the seeded RNG)."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = torch.Generator()
        if params.seed is None:
            self.rng.seed()
        else:
            self.rng.manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor) -> int:
        p = self.params
        logits = logits.float()
        if p.greedy:
            return int(logits.argmax())
        if p.top_k and p.top_k < logits.shape[-1]:
            values, ids = logits.topk(p.top_k)
        else:
            values, ids = logits.sort(descending=True)
        probs = values.softmax(-1)
        keep = probs.shape[-1]
        if p.top_p < 1.0:
            # smallest prefix whose mass reaches top_p (always at least one token)
            cum = probs.cumsum(-1)
            keep = min(keep, int((cum < p.top_p).sum()) + 1)
        if p.min_p > 0.0:
            keep = min(keep, max(1, int((probs >= p.min_p * probs[0]).sum())))
        values, ids = values[:keep], ids[:keep]
        probs = (values / p.temperature).softmax(-1)
        return int(ids[torch.multinomial(probs, 1, generator=self.rng)])
