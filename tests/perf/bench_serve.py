"""Serving benchmark: N concurrent streaming clients against any OpenAI-compatible server.

Not a test: its figures go, with command, machine and date, into tests/perf/results/server.md
(the GPU runs come from tests/perf/gpu_serve.sh). For each concurrency level, C clients stream
`/v1/completions` requests back to back (closed loop): warm-up requests first (not recorded),
then the measured ones. Per level it reports aggregate output tokens/s and requests/s over the
measured wall time, time to first token (TTFT) and inter-token latency (ITL: the gaps between
SSE chunks that carry text) at p50/p99, time per output token per request, and errors (a
failed request, or one that made another number of tokens than --gen: no server's figures may
count less work).

Prompts are token ids, so every server gets the very same ones (same GGUF, same tokenizer): a
seeded mix of a shared system prompt, one of a few shared documents (or none) and a request's
own question text, totalling --min-prompt..--max-prompt tokens (cut from English text tokenized
once by the server's `/tokenize`). Every request generates exactly --gen tokens: the
end-of-generation token is ignored (`ignore_eos`, and `min_tokens` where the server takes it).
Which server it is comes from /v1/models' `owned_by` (localllm, llamacpp, vllm; --kind forces).

    python tests/perf/bench_serve.py --url http://127.0.0.1:8080 --concurrency 1,4,16,64 \
        [--gen 256] [--min-prompt 512] [--max-prompt 2048] [--json out.json] [--label ours]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import platform
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

# fields beyond OpenAI's that make a server generate exactly max_tokens, by server kind
EXACT_LENGTH = {
    "localllm": lambda gen: {"ignore_eos": True, "min_tokens": gen},
    "vllm": lambda gen: {"ignore_eos": True, "min_tokens": gen},
    "llamacpp": lambda gen: {"ignore_eos": True},  # (no min_tokens; n_predict = max_tokens)
    "openai": lambda gen: {},
}


def _paragraphs() -> tuple[str, ...]:
    """bench_engine's English paragraphs (that file imports only the standard library)."""
    path = Path(__file__).with_name("bench_engine.py")
    spec = importlib.util.spec_from_file_location("_bench_engine_text", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.PARAGRAPHS


# -- the prompt mix --------------------------------------------------------------------------


@dataclass(frozen=True)
class Mix:
    min_prompt: int = 512
    max_prompt: int = 2048
    system: int = 256  # shared system prompt, every request
    docs: tuple[int, ...] = (256, 512, 1024, 1536)  # shared documents; a request takes one
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.min_prompt <= self.max_prompt:
            raise ValueError("need 1 <= --min-prompt <= --max-prompt")
        if self.system >= self.min_prompt:
            raise ValueError("--system must be shorter than --min-prompt")

    def corpus_tokens(self) -> int:
        """Token ids the text must yield: system, documents, then room for the questions."""
        return self.system + sum(self.docs) + 4 * self.max_prompt


def corpus_text(words_hint: int, seed: int) -> str:
    """English text of about `words_hint` words: the paragraphs' sentences, reshuffled."""
    sentences = [s.strip() for p in _paragraphs() for s in p.split(". ") if s.strip()]
    rng, out, n = random.Random(seed), [], 0
    while n < words_hint:
        rng.shuffle(sentences)
        for s in sentences:
            out.append(s.rstrip(".") + ".")
            n += len(s.split())
    return " ".join(out)


class Prompts:
    """Prompt token ids by key: system + (a shared document) + own text, of a seeded length."""

    def __init__(self, ids: Sequence[int], mix: Mix):
        if len(ids) < mix.corpus_tokens():
            raise ValueError(f"corpus has {len(ids)} tokens, needs {mix.corpus_tokens()}")
        self.mix = mix
        self.system = list(ids[: mix.system])
        at, self.docs = mix.system, []
        for n in mix.docs:
            self.docs.append(list(ids[at : at + n]))
            at += n
        self.own = list(ids[at:])  # questions are cut from here, at seeded offsets

    def get(self, key: str) -> tuple[list[int], int]:
        """(prompt ids, shared prefix length) for request `key` (same key, same prompt)."""
        m = self.mix
        rng = random.Random(f"{m.seed}:{key}")
        total = rng.randint(m.min_prompt, m.max_prompt)
        fits = [d for d in self.docs if m.system + len(d) + 32 <= total]
        doc = rng.choice([[], *fits])  # a fifth of the requests or more carry no document
        n = total - m.system - len(doc)
        at = rng.randrange(len(self.own) - n)
        return self.system + doc + self.own[at : at + n], m.system + len(doc)


# -- one request -----------------------------------------------------------------------------


@dataclass
class Sample:
    prompt_tokens: int
    shared_tokens: int
    start: float = 0.0
    ttft: float | None = None  # seconds to the first chunk with text
    latency: float | None = None  # seconds to the end of the stream
    gaps: list[float] = field(default_factory=list)  # between chunks with text
    chunks: int = 0  # chunks with text
    usage_tokens: int | None = None  # completion_tokens of the final usage
    error: str | None = None

    @property
    def tokens(self) -> int:
        """Output tokens: the server's usage count, else the chunks seen."""
        return self.chunks if self.usage_tokens is None else self.usage_tokens


async def stream_one(
    client: httpx.AsyncClient, body: dict, sample: Sample, expect: int | None = None
) -> Sample:
    """POST one streamed /v1/completions; fills `sample` (an error ends it, never raises). With
    `expect`, a stream that made another number of tokens is an error too: every server must
    make the same work."""
    sample.start = t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                sample.error = f"HTTP {r.status_code}: {text[:200]}"
                return sample
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if "error" in chunk:
                    sample.error = f"stream error: {json.dumps(chunk['error'])[:200]}"
                    return sample
                if chunk.get("usage"):
                    sample.usage_tokens = chunk["usage"].get("completion_tokens")
                if any(c.get("text") for c in chunk.get("choices") or ()):
                    if last is None:
                        sample.ttft = now - t0
                    else:
                        sample.gaps.append(now - last)
                    last = now
                    sample.chunks += 1
        sample.latency = time.perf_counter() - t0
        if sample.chunks == 0:
            sample.error = "no text in the stream"
        elif expect is not None and sample.tokens != expect:
            sample.error = f"made {sample.tokens} of {expect} tokens"
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        sample.error = f"{type(e).__name__}: {e}"
    return sample


# -- statistics ------------------------------------------------------------------------------


def percentile(xs: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between the closest ranks (numpy's default)."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(concurrency: int, samples: Sequence[Sample], wall: float) -> dict:
    """One level's figures (seconds in, milliseconds out); failed requests count as errors only."""
    ok = [s for s in samples if s.error is None]
    ttft = [s.ttft for s in ok]
    itl = [g for s in ok for g in s.gaps]
    tpot = [(s.latency - s.ttft) / (s.tokens - 1) for s in ok if s.tokens > 1]
    tokens = sum(s.tokens for s in ok)

    def ms(x):
        return None if x is None else round(1000 * x, 2)

    return {
        "concurrency": concurrency,
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "first_error": next((s.error for s in samples if s.error), None),
        "wall_s": round(wall, 3),
        "output_tokens": tokens,
        "usage_tokens": sum(s.usage_tokens or 0 for s in ok),
        "chunks": sum(s.chunks for s in ok),
        "prompt_tokens": sum(s.prompt_tokens for s in ok),
        "shared_prefix_tokens": sum(s.shared_tokens for s in ok),
        "output_tok_s": round(tokens / wall, 2) if wall > 0 else None,
        "requests_s": round(len(ok) / wall, 3) if wall > 0 else None,
        "ttft_p50_ms": ms(percentile(ttft, 50)),
        "ttft_p99_ms": ms(percentile(ttft, 99)),
        "itl_p50_ms": ms(percentile(itl, 50)),
        "itl_p99_ms": ms(percentile(itl, 99)),
        "tpot_p50_ms": ms(percentile(tpot, 50)),
        "tpot_p99_ms": ms(percentile(tpot, 99)),
    }


HEADERS = ("server", "streams", "requests", "errors", "out tok/s", "req/s", "TTFT p50 ms",
           "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "TPOT p50 ms")  # fmt: skip


def table_row(label: str, r: dict) -> str:
    keys = ("concurrency", "requests", "errors", "output_tok_s", "requests_s", "ttft_p50_ms",
            "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tpot_p50_ms")  # fmt: skip
    cells = [label] + ["-" if r[k] is None else str(r[k]) for k in keys]
    return "| " + " | ".join(cells) + " |"


def table_head() -> str:
    return "| " + " | ".join(HEADERS) + " |\n|" + "---|" * len(HEADERS)


# -- a run -----------------------------------------------------------------------------------


@dataclass
class Target:
    """The server under test: its URL, model id, kind, and the fields every request carries."""

    client: httpx.AsyncClient
    model: str
    kind: str
    gen: int
    extra: dict = field(default_factory=dict)

    def body(self, prompt: list[int]) -> dict:
        return {"model": self.model, "prompt": prompt, "max_tokens": self.gen,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                **EXACT_LENGTH[self.kind](self.gen), **self.extra}  # fmt: skip


async def run_level(
    target: Target,
    prompts: Prompts,
    concurrency: int,
    n: int,
    tag: str,
    max_seconds: float | None = None,
) -> tuple[list[Sample], float]:
    """`n` requests (keys `tag`-0..) through `concurrency` clients, each starting its next request
    when its last one ends; none starts after `max_seconds`. Returns the samples and the wall time
    from the first start to the last end."""
    queue = list(range(n))[::-1]
    samples: list[Sample] = []
    t0 = time.perf_counter()

    async def client() -> None:
        while queue and (max_seconds is None or time.perf_counter() - t0 < max_seconds):
            i = queue.pop()
            ids, shared = prompts.get(f"{tag}-{i}")
            s = Sample(len(ids), shared)
            samples.append(s)
            await stream_one(target.client, target.body(ids), s, target.gen)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return samples, time.perf_counter() - t0


async def tokenize(client: httpx.AsyncClient, text: str) -> list[int]:
    """Token ids of `text` by the server's /tokenize (llama-server's shape, else vLLM's)."""
    r = await client.post("/tokenize", json={"content": text, "add_special": False})
    if r.status_code != 200:
        r = await client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    r.raise_for_status()
    return r.json()["tokens"]


async def connect(a) -> tuple[Target, Prompts]:
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    limits = httpx.Limits(max_connections=max(a.concurrency) + 8, max_keepalive_connections=None)
    client = httpx.AsyncClient(base_url=a.url, headers=headers, limits=limits,
                               timeout=httpx.Timeout(a.timeout, connect=30))  # fmt: skip
    models = (await client.get("/v1/models")).raise_for_status().json()["data"]
    model = a.model or models[0]["id"]
    kind = a.kind or {"localllm": "localllm", "llamacpp": "llamacpp", "vllm": "vllm"}.get(
        models[0].get("owned_by", ""), "openai"
    )
    mix = Mix(a.min_prompt, a.max_prompt, a.system, tuple(a.docs), a.seed)
    need, words = mix.corpus_tokens(), mix.corpus_tokens()
    while True:  # English runs ~1.3 tokens a word: grow the text until it yields enough
        ids = await tokenize(client, corpus_text(words, a.seed))
        if len(ids) >= need:
            break
        words = words * 2
    extra = json.loads(a.extra_body) if a.extra_body else {}
    return Target(client, model, kind, a.gen, extra), Prompts(ids, mix)


async def bench(a) -> dict:
    """Every level in turn; the JSON (--json) is rewritten after each, so a run cut short keeps
    the levels it finished."""
    target, prompts = await connect(a)
    result = {
        "label": a.label,
        "url": a.url,
        "model": target.model,
        "server_kind": target.kind,
        "gen": a.gen,
        "mix": asdict(prompts.mix),
        "client_machine": platform.node(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "levels": [],
    }
    print(f"# {a.label}: {a.url} model {target.model} ({target.kind}), gen {a.gen}, prompts "
          f"{a.min_prompt}-{a.max_prompt}", file=sys.stderr)  # fmt: skip
    print(table_head(), flush=True)
    try:
        for c in a.concurrency:
            warm = c if a.warmup is None else a.warmup
            warmed, _ = await run_level(target, prompts, c, warm, f"warm{c}")
            n = max(a.rounds * c, a.min_requests)
            start = time.time()  # (wall clock: matched against other logs, e.g. nvidia-smi's)
            samples, wall = await run_level(target, prompts, c, n, f"c{c}", a.max_seconds)
            r = summarize(c, samples, wall)
            r["unix_start"], r["unix_end"] = round(start, 3), round(time.time(), 3)
            ok = [s for s in warmed if s.error is None]  # (kept apart: servers' counters see them)
            r["warmup"] = {"requests": len(warmed), "errors": len(warmed) - len(ok),
                           "output_tokens": sum(s.tokens for s in ok),
                           "prompt_tokens": sum(s.prompt_tokens for s in ok)}  # fmt: skip
            result["levels"].append(r)
            print(table_row(a.label, r), flush=True)
            if a.json:
                Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    finally:
        await target.client.aclose()
    return result


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080", help="server base URL")
    ap.add_argument("--model", help="model id (default: the first /v1/models lists)")
    ap.add_argument("--kind", choices=sorted(EXACT_LENGTH), help="server kind (from owned_by)")
    ap.add_argument("--api-key", help="sent as `Authorization: Bearer KEY`")
    ap.add_argument("--label", default="server", help="first column of the table")
    ap.add_argument("--concurrency", type=ints, default=[1, 4, 16, 64], help="1,4,16,64")
    ap.add_argument("--gen", type=int, default=256, help="tokens generated per request (256)")
    ap.add_argument("--min-prompt", type=int, default=512, help="shortest prompt (512 tokens)")
    ap.add_argument("--max-prompt", type=int, default=2048, help="longest prompt (2048 tokens)")
    ap.add_argument("--system", type=int, default=256, help="shared system prompt (256 tokens)")
    ap.add_argument("--docs", type=ints, default=[256, 512, 1024, 1536],
                    help="shared documents' lengths in tokens (256,512,1024,1536)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2, help="measured requests per client (2)")
    ap.add_argument("--min-requests", type=int, default=8, help="measured requests at least (8)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up requests (the level's C)")
    ap.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="start no measured request after this many seconds of a level (no limit)",
    )
    ap.add_argument("--timeout", type=float, default=600, help="seconds per request (600)")
    ap.add_argument("--extra-body", help="JSON object merged into every request body")
    ap.add_argument("--json", help="write the results here")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if not a.concurrency or min(a.concurrency) < 1 or a.gen < 1:
        raise SystemExit("bench_serve: --concurrency values and --gen must be >= 1")
    try:
        result = asyncio.run(bench(a))
    except (ValueError, httpx.HTTPError) as e:  # a bad mix, or no server there: one line
        raise SystemExit(f"bench_serve: {type(e).__name__}: {e}") from None
    return 1 if any(r["errors"] for r in result["levels"]) else 0


if __name__ == "__main__":
    sys.exit(main())
