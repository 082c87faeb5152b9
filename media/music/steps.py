"""The decode loop's step objects over one generation's conditioning: `first(seq)` runs the
positions before the first one to generate and `next(seq)` one more position, each answering
(rows, K, vocab) float32 logits of the last position.

- `CachedSteps`: prefill the KV cache once, then one position per step (the CPU path).
- `StaticSteps`: the same step in a static form (inputs copied into fixed tensors, the cache
  written at a position tensor, attention over the whole cache under a mask), captured as a
  CUDA graph and replayed each step (`capture=True`, CUDA only), or run eagerly, which tests
  the captured math on any device.
- `Recompute`: the reference, everything recomputed each step through `MusicLM.reference`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localllm.media.music.lm import MusicLM


@dataclass
class Condition:
    rows: int  # 2 with guidance (conditional, unconditional), else 1
    prefix: torch.Tensor | None = None  # melody models: (rows, P, hidden)
    cross_kv: list | None = None  # MusicGen: per layer, conditional row only
    cross: torch.Tensor | None = None  # (rows, S, hidden), for the reference path
    cross_mask: torch.Tensor | None = None


class CachedSteps:
    """The fast path: prefill the cache once, then one position per step."""

    def __init__(self, lm: MusicLM, cond: Condition, length: int):
        self.lm, self.cond = lm, cond
        prefix = cond.prefix.shape[1] if cond.prefix is not None else 0
        self.cache = lm.new_cache(cond.rows, prefix + length)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lm.add_positions(x, self.cache.length)
        rows = 1 if self.cond.cross_kv is not None else 0
        h = self.lm.forward_cached(x, self.cache, self.cond.cross_kv, rows)
        return self.lm.logits(h[:, -1:], fast=True)[:, :, 0].float()  # (rows, K, vocab)

    def first(self, seq: torch.Tensor) -> torch.Tensor:
        x = self.lm.embed(seq[None].expand(self.cond.rows, -1, -1))
        if self.cond.prefix is not None:
            x = torch.cat([self.cond.prefix, x], dim=1)
        return self._run(x)

    def next(self, seq: torch.Tensor) -> torch.Tensor:
        return self._run(self.lm.embed(seq[None, :, -1:].expand(self.cond.rows, -1, -1)))


class Recompute:
    """The reference path: the whole sequence through `MusicLM.reference` every step."""

    def __init__(self, lm: MusicLM, cond: Condition):
        self.lm, self.cond = lm, cond

    def first(self, seq: torch.Tensor) -> torch.Tensor:
        return self.next(seq)

    def next(self, seq: torch.Tensor) -> torch.Tensor:
        x = self.lm.embed(seq[None].expand(self.cond.rows, -1, -1))
        if self.cond.prefix is not None:
            x = torch.cat([self.cond.prefix, x], dim=1)
        x = self.lm.add_positions(x, 0)
        return self.lm.reference(x, self.cond.cross, self.cond.cross_mask)[:, :, -1].float()


class StaticSteps(CachedSteps):
    """`CachedSteps` whose one-position step reads only fixed tensors, so it can be captured
    once as a CUDA graph and replayed (`capture=True`); the prefill stays eager."""

    def __init__(self, lm: MusicLM, cond: Condition, length: int, capture: bool):
        super().__init__(lm, cond, length)
        dev = lm.embeds.device
        self.capture, self.graph, self.out = capture, None, None
        self.codes = torch.zeros(cond.rows, lm.args.num_codebooks, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        lm.ensure_positions(self.cache.k.shape[3])  # the table must not grow inside a graph

    def _static(self) -> torch.Tensor:
        x = self.lm.embed(self.codes) + self.lm.positions.index_select(0, self.pos)
        rows = 1 if self.cond.cross_kv is not None else 0
        h = self.lm.forward_cached(x, self.cache, self.cond.cross_kv, rows, pos=self.pos)
        return self.lm.logits(h, fast=True)[:, :, 0].float()

    def next(self, seq: torch.Tensor) -> torch.Tensor:
        """The step's logits; with a graph, its output tensor, overwritten by the next step."""
        self.codes.copy_(seq[None, :, -1:].expand_as(self.codes))
        self.pos.fill_(self.cache.length)
        self.cache.length += 1
        if not self.capture:
            return self._static()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.out

    def _capture(self) -> None:
        # warm-up on a side stream (first calls allocate and pick kernels), then capture; both
        # write the same cache slot the replay rewrites, so they change nothing
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._static()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self._static()
