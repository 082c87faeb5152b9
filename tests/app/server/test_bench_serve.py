"""tests/perf/bench_serve.py against the real `localllm serve` (the session's SmolLM2 server):
its token accounting agrees with the server's usage and /metrics counters, its percentiles with
numpy's, and failed requests count as errors only. No timing is asserted."""

import asyncio
import json
import random

import httpx
import numpy as np
import pytest

from tests.app.server.conftest import API_KEY
from tests.perf.bench_serve import (
    Mix,
    Prompts,
    Sample,
    Target,
    main,
    percentile,
    run_level,
    summarize,
)

GEN = 5


@pytest.mark.parametrize("n", [1, 2, 7, 100])
def test_percentile_matches_numpy(n):
    xs = [random.Random(n).expovariate(3.0) for _ in range(n)]
    for q in (0, 1, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)
    assert percentile([], 50) is None


def _counters(server) -> tuple[float, float]:
    m = server.metrics()
    return m["vllm:generation_tokens_total"], m["vllm:prompt_tokens_total"]


def test_levels_count_what_the_server_counts(server, tmp_path):
    gen0, prompt0 = _counters(server)
    out = tmp_path / "bench.json"
    argv = ["--url", server.base, "--api-key", API_KEY, "--concurrency", "1,3",
            "--gen", str(GEN), "--min-prompt", "40", "--max-prompt", "120", "--system", "16",
            "--docs", "16,48", "--warmup", "1", "--rounds", "1", "--min-requests", "4",
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert r["server_kind"] == "localllm" and r["model"] == server.model_id
    levels = r["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 3]
    assert [lv["requests"] for lv in levels] == [4, 4]
    for lv in levels:
        assert lv["errors"] == 0 and lv["warmup"]["errors"] == 0
        # every request made exactly GEN tokens (ignore_eos + min_tokens), one chunk each
        assert lv["output_tokens"] == lv["usage_tokens"] == lv["chunks"] == 4 * GEN
        assert 4 * 40 <= lv["prompt_tokens"] <= 4 * 120
        assert lv["ttft_p50_ms"] <= lv["ttft_p99_ms"] and lv["itl_p50_ms"] <= lv["itl_p99_ms"]
    gen1, prompt1 = _counters(server)
    # the server's own counters moved by what the benchmark sent and received, warm-ups included
    assert gen1 - gen0 == sum(lv["output_tokens"] + lv["warmup"]["output_tokens"] for lv in levels)
    assert prompt1 - prompt0 == sum(
        lv["prompt_tokens"] + lv["warmup"]["prompt_tokens"] for lv in levels
    )


def test_summary_percentiles_are_of_the_samples(server):
    async def go():
        async with httpx.AsyncClient(base_url=server.base, headers=server.headers,
                                     timeout=120) as client:  # fmt: skip
            ids = (await client.post("/tokenize", json={"content": "word " * 1000})).json()
            prompts = Prompts(ids["tokens"], Mix(40, 100, 8, (8, 24), seed=3))
            target = Target(client, server.model_id, "localllm", GEN)
            return await run_level(target, prompts, 2, 3, "t")

    samples, wall = asyncio.run(go())
    r = summarize(2, samples, wall)
    ttft = [s.ttft for s in samples]
    gaps = [g for s in samples for g in s.gaps]
    assert all(len(s.gaps) == s.chunks - 1 == GEN - 1 for s in samples)
    assert r["ttft_p99_ms"] == round(1000 * float(np.percentile(ttft, 99)), 2)
    assert r["itl_p50_ms"] == round(1000 * float(np.percentile(gaps, 50)), 2)
    assert r["output_tok_s"] == round(3 * GEN / wall, 2)


def test_prompt_mix_is_seeded_and_shares_prefixes():
    ids = list(range(10_000))
    mix = Mix(100, 300, 20, (30, 60), seed=7)
    p = Prompts(ids, mix)
    a, shared_a = p.get("k1")
    assert p.get("k1") == (a, shared_a)  # same key, same prompt
    assert 100 <= len(a) <= 300 and a[:20] == ids[:20]  # the system prompt leads every one
    assert shared_a in (20, 50, 80)
    lens = {p.get(f"k{i}")[1] for i in range(60)}
    assert lens == {20, 50, 80}  # with no document, or either one
    with pytest.raises(ValueError, match="corpus has 50 tokens"):
        Prompts(ids[:50], mix)
    with pytest.raises(ValueError, match="--system must be shorter"):
        Mix(100, 300, 100)


def test_failed_requests_are_errors_not_tokens(server):
    async def go():
        async with httpx.AsyncClient(base_url=server.base, headers=server.headers,
                                     timeout=120) as client:  # fmt: skip
            # longer than the server's context (1024): every request is refused with a 400
            prompts = Prompts(list(range(100, 9000)), Mix(1100, 1200, 8, (), seed=1))
            target = Target(client, server.model_id, "localllm", GEN)
            return await run_level(target, prompts, 2, 3, "bad")

    samples, wall = asyncio.run(go())
    r = summarize(2, samples, wall)
    assert r["errors"] == r["requests"] == 3 and r["output_tokens"] == 0
    assert r["first_error"].startswith("HTTP 400")
    assert r["ttft_p50_ms"] is None
    assert isinstance(samples[0], Sample) and samples[0].usage_tokens is None


def test_report_gives_no_ratio_where_a_server_failed_requests():
    from tests.perf.serve_report import report

    def run(label, levels):
        return {"label": label, "levels": [
            {"concurrency": c, "requests": 8, "errors": e, "output_tok_s": t, "requests_s": 1.0,
             "ttft_p50_ms": 1.0, "ttft_p99_ms": 2.0, "itl_p50_ms": 3.0, "itl_p99_ms": 4.0,
             "tpot_p50_ms": 3.0, "warmup": {"errors": w}} for c, e, w, t in levels]}  # fmt: skip

    ours = run("ours", [(1, 0, 0, 300.0), (16, 0, 0, 900.0), (64, 2, 0, 1000.0)])
    theirs = run("llama", [(1, 0, 0, 100.0), (16, 5, 1, 250.0), (64, 0, 0, 500.0)])
    text = report([ours, theirs], "llama")
    rows = {line.split(" | ")[1]: line for line in text.splitlines() if "no ratio" in line}
    assert "| ours | 1 | 3.00x |" in text
    assert "no ratio: 0 errors here, 6 in llama" in rows["16"]
    assert "no ratio: 2 errors here, 0 in llama" in rows["64"]
    assert "3.60x" not in text and "2.00x" not in text


def test_a_stream_short_of_its_tokens_is_an_error(server):
    async def go():
        async with httpx.AsyncClient(base_url=server.base, headers=server.headers,
                                     timeout=120) as client:  # fmt: skip
            ids = (await client.post("/tokenize", json={"content": "word " * 1000})).json()
            prompts = Prompts(ids["tokens"], Mix(40, 100, 8, (8, 24), seed=4))
            # the body asks for 2 tokens while the run expects GEN: the server makes 2
            target = Target(client, server.model_id, "localllm", GEN,
                            {"max_tokens": 2, "min_tokens": 2})  # fmt: skip
            return await run_level(target, prompts, 1, 2, "short")

    samples, wall = asyncio.run(go())
    r = summarize(1, samples, wall)
    assert r["errors"] == r["requests"] == 2 and r["output_tokens"] == 0
    assert r["first_error"] == f"made 2 of {GEN} tokens"
    assert all(s.usage_tokens == 2 for s in samples)
