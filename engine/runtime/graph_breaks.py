"""Host breaks in a captured decode step: pieces of CUDA graph with host work between them.

A decode step whose MoE layers need the host (experts streamed from disk into slots, computed on
the CPU, or any expert path that reads routing on the host) cannot be one graph, and run eagerly
it is bound by Python dispatch (~66 ms per token for a 48-layer MoE on an H200 where the graph
takes 3). Captured with breaks it becomes a chain: graph 0, host step 0, graph 1, ... Each host
step reads static device tensors the graph before it wrote (routing ids, hidden rows), does its
host work, and writes static device tensors the graph after it reads. All pieces share one memory
pool; replaying them in capture order is what makes that safe.
"""

import contextlib
from collections.abc import Callable

import torch


class HostBreaks:
    """A chain of CUDA graphs captured on the current stream, with a host step after each but
    the last. A module that needs the host during capture calls `host(step)`; `replay()` then
    runs the chain. Steps run on the current stream between the graphs, eagerly."""

    def __init__(self, pool=None):
        self.pool = pool
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.steps: list[Callable[[], None]] = []
        self._capturing: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        g = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        # thread_local: a read-ahead thread may copy an expert in while the pieces are captured
        g.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        self._capturing = g

    def host(self, step: Callable[[], None]) -> None:
        """End the graph being captured; `step` runs after it at every replay (never during
        capture: the captured kernels have not run, so what it would read is not there yet)."""
        self._end()
        self.steps.append(step)
        self.begin()

    def fork(self) -> torch.cuda.Event:
        """End the graph being captured and begin the next; at every replay an event is recorded
        between the two, which a later host step can wait on alone while the GPU runs on."""
        event = torch.cuda.Event()
        self._end()
        self.steps.append(event.record)
        self.begin()
        return event

    def end(self) -> None:
        self._end()

    def abort(self) -> None:
        """End a capture that failed half-way (its error is the caller's to raise)."""
        if self._capturing is not None:
            with contextlib.suppress(RuntimeError):  # already invalidated: nothing to keep
                self._capturing.capture_end()
            self._capturing = None

    def _end(self) -> None:
        self._capturing.capture_end()
        self.graphs.append(self._capturing)
        self._capturing = None

    def replay(self) -> None:
        for graph, step in zip(self.graphs, self.steps, strict=False):
            graph.replay()
            step()
        self.graphs[-1].replay()

    def __len__(self) -> int:
        return len(self.graphs)
