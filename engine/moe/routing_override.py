"""Routing chosen for a measurement instead of by the model's router (`bench --routing`).

A random-weight model routes unevenly (its hidden states share a few large directions), so an
expert cache hits far more often than on a trained model, whose experts are balanced. To measure
offload as users see it, the experts each token uses can be drawn instead:

- `uniform`: k distinct experts per token and layer, each equally likely (what a perfectly
  balanced model approaches);
- `zipf:S`: k distinct experts drawn with probability proportional to 1 / rank^S over a fixed
  random ranking per layer (S = 1: a few popular experts, a long tail);
- `trace:FILE`: expert ids replayed from a `.npy` array [tokens, layers, k] (one recorded from a
  real model), token after token, wrapping around.

The router still runs (its cost is part of a step) and its top-k weights are kept, given to the
drawn experts. Draws are device tensor ops (Gumbel top-k), so they replay inside a captured CUDA
graph with fresh random numbers each step.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass(frozen=True)
class RoutingSpec:
    kind: str  # "model", "uniform", "zipf" or "trace"
    zipf_s: float = 1.0
    trace: Path | None = None


def parse_routing(text: str) -> RoutingSpec:
    """`model`, `uniform`, `zipf:S` or `trace:FILE`; a ValueError naming the form otherwise."""
    kind, _, arg = text.partition(":")
    if kind in ("model", "uniform") and not arg:
        return RoutingSpec(kind)
    if kind == "zipf":
        try:
            s = float(arg or 1.0)
        except ValueError:
            s = -1.0
        if not 0.0 <= s <= 10.0:
            raise ValueError(f"--routing zipf:S needs S between 0 and 10, not {arg!r}")
        return RoutingSpec("zipf", zipf_s=s)
    if kind == "trace" and arg:
        return RoutingSpec("trace", trace=Path(arg).expanduser())
    raise ValueError(f"--routing {text!r}: use model, uniform, zipf:S or trace:FILE")


class RoutingOverride:
    """The drawn routing of one model (see the module docstring); `choose` per MoE layer."""

    def __init__(self, spec: RoutingSpec, n_layers: int, n_expert: int, k: int, seed: int = 0):
        if spec.kind not in ("uniform", "zipf", "trace"):
            raise ValueError(f"no override for routing {spec.kind!r}")
        self.spec, self.n_expert, self.k = spec, n_expert, k
        gen = torch.Generator().manual_seed(seed)
        self.log_p: torch.Tensor | None = None  # [layers, experts] for zipf
        self.trace: torch.Tensor | None = None
        self.cursor: torch.Tensor | None = None  # per layer: the next trace row
        if spec.kind == "zipf":
            ranks = torch.stack([torch.randperm(n_expert, generator=gen) for _ in range(n_layers)])
            self.log_p = -spec.zipf_s * torch.log1p(ranks.float())  # rank 0 -> 1 / 1^S
        elif spec.kind == "trace":
            self.trace = load_trace(spec.trace, n_layers, n_expert, k)
            self.cursor = torch.zeros(n_layers, dtype=torch.int64)

    def to(self, device: torch.device) -> "RoutingOverride":
        for name in ("log_p", "trace", "cursor"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))
        return self

    def choose(self, layer: int, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Expert ids [T, k] for this layer in place of the router's `ids` (`weights` keep their
        order: the router's largest weight goes to the first drawn expert)."""
        t = ids.shape[0]
        if self.trace is not None:
            rows = (self.cursor[layer] + torch.arange(t, device=ids.device)) % self.trace.shape[0]
            self.cursor[layer] += t  # in place: a captured graph advances it on every replay
            return self.trace[rows, layer].to(ids.dtype)
        u = torch.rand(t, self.n_expert, device=ids.device).clamp_(min=1e-20)
        scores = -torch.log(-torch.log(u))  # Gumbel: top-k of log p + G draws without replacement
        if self.log_p is not None:
            scores = scores + self.log_p[layer]
        return scores.topk(self.k, dim=-1).indices.to(ids.dtype)


def load_trace(path: Path | None, n_layers: int, n_expert: int, k: int) -> torch.Tensor:
    """A routing trace [tokens, layers, k] of expert ids, checked against the model."""
    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"--routing trace:{path}: not a readable .npy array ({e})") from None
    if arr.ndim != 3 or arr.shape[0] < 1 or arr.shape[1:] != (n_layers, k):
        raise ValueError(f"--routing trace:{path}: shape {arr.shape}, this model needs "
                         f"[tokens, {n_layers}, {k}]")  # fmt: skip
    if not np.issubdtype(arr.dtype, np.integer) or arr.min() < 0 or arr.max() >= n_expert:
        raise ValueError(f"--routing trace:{path}: ids must be integers in [0, {n_expert})")
    return torch.from_numpy(arr.astype(np.int64))


def override_routing(
    model: torch.nn.Module, spec: RoutingSpec, device: torch.device | str, seed: int = 0
) -> int:
    """Give every MoE layer of `model` the drawn routing `spec`; the number of layers changed
    (0 for a dense model, or for `model` routing, which clears any override)."""
    from localllm.engine.moe.block import MoEFeedForward

    blocks = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    if spec.kind == "model" or not blocks:
        for b in blocks:
            b.routing_override = None
        return 0
    n_expert = blocks[0].ffn_gate_inp.out_features
    k = blocks[0].n_used
    n_layers = max(b.layer for b in blocks) + 1
    shared = RoutingOverride(spec, n_layers, n_expert, k, seed).to(torch.device(device))
    for b in blocks:
        b.routing_override = shared
    return len(blocks)
