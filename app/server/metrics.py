"""GET /metrics: Prometheus text with vLLM's metric names, from server counters and engine gauges.

`ServerMetrics` lives on `app.state` (one per app, no module state); endpoints report each
request's end to it. Gauges are read from the engine at scrape time.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from localllm.engine.core.outputs import RequestOutput
from localllm.offload.expert_stats import expert_stats

# vLLM's TTFT buckets (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip


# ExpertStats fields exposed as counters, with their help text.
EXPERT_COUNTERS = (
    ("lookups", "Routed-expert uses looked up in the expert cache."),
    ("hits", "Expert lookups served from a resident slot."),
    ("misses", "Expert lookups that read the expert from the file."),
    ("bytes_read", "Expert bytes read from the file."),
    ("stall_seconds", "Seconds compute waited on expert reads."),
    ("read_seconds", "Seconds spent reading experts (foreground and read-ahead)."),
    ("prefetched", "Experts read ahead on a guess of a coming layer's routing."),
    ("prefetch_hits", "Expert lookups served by a read-ahead."),
    ("guessed", "Experts guessed for a coming layer (read-ahead)."),
    ("guessed_right", "Guessed experts the layer then routed to."),
    ("prepared", "Streamed experts prepared for CPU compute after their read."),
    ("cpu_pairs", "Routed pairs the CPU computed beside the device (split), counted as hits."),
)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self):
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        self.n += 1
        self.total += value
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1


@dataclass
class ServerMetrics:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))

    def record(self, last: RequestOutput | None, reason: str) -> None:
        """One request ended (finished, aborted, failed); `last` is its last delta, if any."""
        self.finished[reason] = self.finished.get(reason, 0) + 1
        if last is None:
            return
        self.prompt_tokens += last.usage.prompt_tokens
        self.generation_tokens += last.usage.completion_tokens
        m = last.metrics
        if m is not None and m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m is not None and m.e2e is not None:
            self.e2e.observe(m.e2e)


def _line(name: str, value: float, labels: dict[str, str]) -> str:
    # model_name first, as before: label order is part of what scrapers and tests match.
    lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
    v = repr(float(value)) if math.isfinite(value) else "NaN"
    return f"{name}{{{lab}}} {v}"


def render(models: list[tuple[str, ServerMetrics, Any]]) -> str:
    """Prometheus text for (model name, its counters, its engine or None when unloaded)."""
    out: list[str] = []
    loaded = [(name, e.engine) for name, _, e in models if e is not None]

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float, dict]]) -> None:
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(_line(n, v, lab) for n, v, lab in samples)

    def gauge(name: str, help_: str, value: Callable[[Any], float]) -> None:
        metric(name, "gauge", help_, [(name, value(c), {"model_name": m}) for m, c in loaded])

    def counter(name: str, help_: str, value: Callable[[ServerMetrics], float]) -> None:
        # Prometheus exposes a counter `x` as the sample `x_total`, as vLLM's /metrics shows.
        samples = [(f"{name}_total", value(sm), {"model_name": m}) for m, sm, _ in models]
        metric(name, "counter", help_, samples)

    def engine_counter(name: str, help_: str, value: Callable[[Any], float]) -> None:
        samples = [(f"{name}_total", value(c), {"model_name": m}) for m, c in loaded]
        metric(name, "counter", help_, samples)

    def histogram(name: str, help_: str, pick: Callable[[ServerMetrics], Histogram]) -> None:
        samples: list[tuple[str, float, dict]] = []
        for m, sm, _ in models:
            h, base = pick(sm), {"model_name": m}
            pairs = zip(h.buckets, h.counts, strict=True)
            samples += [(f"{name}_bucket", c, {**base, "le": repr(b)}) for b, c in pairs]
            samples += [(f"{name}_bucket", h.n, {**base, "le": "+Inf"}),
                        (f"{name}_count", h.n, base), (f"{name}_sum", h.total, base)]  # fmt: skip
        metric(name, "histogram", help_, samples)

    gauge("vllm:num_requests_running", "Sequences in the running batch.",
          lambda c: len(c.scheduler.running))  # fmt: skip
    gauge("vllm:num_requests_waiting", "Sequences waiting to be scheduled.",
          lambda c: len(c.scheduler.waiting))  # fmt: skip
    gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full).", lambda c: c.kv_manager.usage)
    gauge("localllm:kv_cache_free_blocks", "Free KV-cache blocks.",
          lambda c: c.kv_manager.num_free_blocks)  # fmt: skip
    if len(models) > 1:  # the router's view; a single-model server always has its model loaded
        names = {m for m, _ in loaded}
        metric("localllm:model_loaded", "gauge", "1 when the model is loaded.",
               [("localllm:model_loaded", float(m in names), {"model_name": m})
                for m, _, _ in models])  # fmt: skip
    engine_counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                   lambda c: c.kv_manager.stats.queries)  # fmt: skip
    engine_counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                   lambda c: c.kv_manager.stats.hits)  # fmt: skip
    streamed = [
        (m, c) for m, c in loaded if getattr(getattr(c, "model", None), "expert_sources", None)
    ]
    if streamed:  # MoE models loaded under a residency plan: the expert cache's counters
        stats = {m: expert_stats(c.model.expert_sources) for m, c in streamed}
        for key, help_ in EXPERT_COUNTERS:
            name = f"localllm:expert_{key}"
            samples = [(f"{name}_total", float(getattr(st, key)), {"model_name": m})
                       for m, st in stats.items()]  # fmt: skip
            metric(name, "counter", help_, samples)
    counter("vllm:prompt_tokens", "Prefill tokens processed.", lambda sm: sm.prompt_tokens)
    counter("vllm:generation_tokens", "Tokens generated.", lambda sm: sm.generation_tokens)
    success = []
    for m, sm, _ in models:
        for r in sorted(set(sm.finished) | {"stop", "length", "abort"}):
            labels = {"model_name": m, "finished_reason": r}
            success.append(("vllm:request_success_total", sm.finished.get(r, 0), labels))
    metric("vllm:request_success", "counter", "Requests ended, by finish reason.", success)
    histogram("vllm:time_to_first_token_seconds", "Time to first token.", lambda sm: sm.ttft)
    histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", lambda sm: sm.e2e)
    return "\n".join(out) + "\n"


router = APIRouter()


@router.get("/metrics")
async def get_metrics(request: Request, model: str | None = None) -> PlainTextResponse:
    """Every model the server knows (`?model=NAME`: just that one); engine gauges for the loaded."""
    r = request.app.state.router
    entries = [r.find(model)] if model else r.entries
    text = render([(e.id, r.metrics_for(e.id), r.engine(e)) for e in entries])
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")
