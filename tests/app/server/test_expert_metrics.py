"""/metrics exposes the expert cache's counters for a MoE model served with streamed experts."""

from dataclasses import replace

import httpx
import pytest
from gguf import GGMLQuantizationType

from tests.app.server.conftest import serve_process
from tests.offload.tiny_moe import QWEN3MOE, write_moe_gguf

SPEC = replace(QWEN3MOE, expert_qtype=GGMLQuantizationType.Q8_0)


COUNTERS = {"lookups", "hits", "misses", "bytes_read", "stall_seconds", "read_seconds"}
COUNTERS |= {"prefetched", "prefetch_hits", "guessed", "guessed_right", "prepared", "cpu_pairs"}


def _serve(tmp_path_factory, prefetch: str, slots: int = 2):
    model = write_moe_gguf(tmp_path_factory.mktemp("moe") / "moe.gguf", SPEC)
    args = ["-m", str(model), "--experts", "disk", "--expert-slots", str(slots)]
    args += ["--expert-prefetch", prefetch]
    return serve_process(args, tmp_path_factory.mktemp("serve-moe"))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    # no read-ahead: every byte read is then a miss's (read-aheads count their bytes too)
    with _serve(tmp_path_factory, "off") as (url, _):
        yield url


def _experts(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("localllm:expert_"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0].removeprefix("localllm:expert_").removesuffix("_total")] = float(
                value
            )
    return out


def test_expert_counters_follow_generation(base):
    before = _experts(base)
    assert set(before) == COUNTERS
    body = {"prompt": "hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = httpx.post(base + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    after = _experts(base)
    assert after["cpu_pairs"] == 0  # (no split on a CPU: nothing computes beside a device)
    lookups = after["lookups"] - before["lookups"]
    tokens = r.json()["usage"]["prompt_tokens"] + 6
    # Every layer routes each token to n_used experts; the forward of the last token is not run.
    assert SPEC.n_layers * SPEC.n_used <= lookups <= SPEC.n_layers * SPEC.n_used * tokens
    assert after["hits"] + after["misses"] == after["lookups"]
    per_expert = SPEC.expert_nbytes // (SPEC.n_layers * SPEC.n_expert)
    assert after["bytes_read"] == after["misses"] * per_expert > 0
    assert after["prefetched"] == after["guessed"] == after["prefetch_hits"] == 0
    assert after["prepared"] == after["misses"]  # a CPU server prepares each expert it reads


def test_read_ahead_counters(tmp_path_factory):
    # free slots beyond the current layer's two experts, so guesses can be read ahead
    with _serve(tmp_path_factory, "on", slots=6) as (url, _):
        body = {"prompt": "hello there", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        got = _experts(url)
    assert got["guessed"] > 0 and 0 <= got["guessed_right"] <= got["guessed"]
    assert got["prefetched"] > 0 and got["prefetch_hits"] <= got["prefetched"]
    assert got["hits"] + got["misses"] == got["lookups"]
    assert got["read_seconds"] > 0
