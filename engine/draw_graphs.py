"""The device draw (`engine.device_sampling`) captured as a CUDA graph: one replay where the eager
draw makes ~40 small launches every token.

On a split residency those launches sat between the decode step's replay and the host's native
call for the CPU's shares, so every split layer waited for them (~1 ms a token on the H200 host);
all on the GPU they were the draw's whole cost (~0.3 ms). A graph is captured per (rows,
vocabulary, logits dtype, whether top_p / min_p are on) for steps whose every row is drawn, up to
`MAX_ROWS` rows; the logits are copied into its input and the controls into its [6, n] buffer, so
one graph serves every step of that shape whatever the requests' values. Other steps draw
eagerly. The graphs share one memory pool: nothing of a replay outlives it but its outputs, which
are copied out before the next replay can overwrite them.
"""

import logging
from dataclasses import dataclass

import torch

from localllm.engine.device_sampling import DeviceDraw, controls, pick, tokens

log = logging.getLogger(__name__)

MAX_ROWS = 8  # a graph per row count holds its logits' copy: larger steps draw eagerly

GraphKey = tuple[int, int, torch.dtype, bool, bool]


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    x: torch.Tensor  # [n, V] the logits, copied in
    ctl: torch.Tensor  # [6, n] the controls, copied in
    best: torch.Tensor  # [n] float32 outputs
    ids: torch.Tensor  # [n] int64


class DrawGraphs:
    """`tokens(logits, draw)` as `device_sampling.tokens` answers it, replayed where it can."""

    def __init__(self) -> None:
        self.graphs: dict[GraphKey, _Graph] = {}
        self.pool = None
        self.failed: str | None = None  # a capture that failed: every draw eager from then on
        self.replays = 0

    def tokens(
        self, logits: torch.Tensor, draw: DeviceDraw | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = logits.detach()
        n, vocab = x.shape
        if (
            draw is None
            or not x.is_cuda
            or n > MAX_ROWS
            or self.failed is not None
            or draw.rows != list(range(n))
        ):
            return tokens(logits, draw)
        ps = draw.params
        key = (n, vocab, x.dtype, any(p.top_p < 1.0 for p in ps), any(p.min_p > 0.0 for p in ps))
        ctl = controls(ps, draw.u, vocab, draw.rows, torch.device("cpu")).pin_memory()
        g = self.graphs.get(key)
        if g is None:
            try:
                g = self.graphs[key] = self._capture(x, ctl.to(x.device), ps)
            except Exception as e:  # (an out-of-memory capture): eager draws still answer
                self.failed = f"{type(e).__name__}: {e}"
                log.warning("draw graph capture failed, eager draws from now on: %s", self.failed)
                return tokens(logits, draw)
        g.x.copy_(x)
        g.ctl.copy_(ctl, non_blocking=True)
        g.graph.replay()
        self.replays += 1
        return g.best.clone(), g.ids.clone()

    def _capture(self, x: torch.Tensor, ctl: torch.Tensor, params) -> _Graph:
        # Captured on a side stream without `torch.cuda.graph`'s device synchronize: a draw is
        # queued behind a decode step whose split layers wait for CPU shares this thread runs
        # only after it returns, so a sync here would wait for the GPU's waits to give up.
        cur = torch.cuda.current_stream(x.device)
        xs, cs = x.clone(), ctl.clone()
        side = torch.cuda.Stream(x.device)
        side.wait_stream(cur)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            pick(xs, cs, params)  # a warm-up: modules load at these launches, not in the capture
            graph.capture_begin(self.pool, capture_error_mode="thread_local")
            try:
                best, ids = pick(xs, cs, params)
            finally:
                graph.capture_end()
        cur.wait_stream(side)
        self.pool = graph.pool()
        return _Graph(graph, xs, cs, best, ids)
