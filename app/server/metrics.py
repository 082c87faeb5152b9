"""GET /metrics: Prometheus text with vLLM's metric names, from server counters and engine gauges.

`ServerMetrics` lives on `app.state` (one per app, no module state); endpoints report each
request's end to it. Gauges are read from the engine at scrape time.
"""

import math
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from localllm.engine.core.outputs import RequestOutput

# vLLM's TTFT buckets (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip


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
    lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
    v = repr(float(value)) if math.isfinite(value) else "NaN"
    return f"{name}{{{lab}}} {v}"


def render(metrics: ServerMetrics, engine, model_name: str) -> str:
    base = {"model_name": model_name}
    core = engine.engine
    kv, sched = core.kv_manager, core.scheduler
    out: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float, dict]]) -> None:
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(_line(n, v, {**base, **lab}) for n, v, lab in samples)

    def gauge(name: str, help_: str, value: float) -> None:
        metric(name, "gauge", help_, [(name, value, {})])

    def counter(name: str, help_: str, value: float) -> None:
        # Prometheus exposes a counter `x` as the sample `x_total`, as vLLM's /metrics shows.
        metric(name, "counter", help_, [(f"{name}_total", value, {})])

    def histogram(name: str, help_: str, h: Histogram) -> None:
        pairs = zip(h.buckets, h.counts, strict=True)
        samples = [(f"{name}_bucket", c, {"le": repr(b)}) for b, c in pairs]
        samples += [(f"{name}_bucket", h.n, {"le": "+Inf"}), (f"{name}_count", h.n, {})]
        samples.append((f"{name}_sum", h.total, {}))
        metric(name, "histogram", help_, samples)

    gauge("vllm:num_requests_running", "Sequences in the running batch.", len(sched.running))
    gauge("vllm:num_requests_waiting", "Sequences waiting to be scheduled.", len(sched.waiting))
    gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full).", kv.usage)
    gauge("localllm:kv_cache_free_blocks", "Free KV-cache blocks.", kv.num_free_blocks)
    counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
            kv.stats.queries)  # fmt: skip
    counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", kv.stats.hits)
    counter("vllm:prompt_tokens", "Prefill tokens processed.", metrics.prompt_tokens)
    counter("vllm:generation_tokens", "Tokens generated.", metrics.generation_tokens)
    reasons = sorted(set(metrics.finished) | {"stop", "length", "abort"})
    metric(
        "vllm:request_success",
        "counter",
        "Requests ended, by finish reason.",
        [("vllm:request_success_total", metrics.finished.get(r, 0), {"finished_reason": r})
         for r in reasons],
    )  # fmt: skip
    histogram("vllm:time_to_first_token_seconds", "Time to first token.", metrics.ttft)
    histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", metrics.e2e)
    return "\n".join(out) + "\n"


router = APIRouter()


@router.get("/metrics")
async def get_metrics(request: Request) -> PlainTextResponse:
    state = request.app.state
    text = render(state.metrics, state.engine, state.settings.model_id)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")
