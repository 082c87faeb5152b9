"""/metrics exposes the expert cache's counters for a MoE model served with streamed experts."""

from dataclasses import replace

import httpx
import pytest
from gguf import GGMLQuantizationType

from tests.app.server.conftest import serve_process
from tests.offload.tiny_moe import QWEN3MOE, write_moe_gguf

SPEC = replace(QWEN3MOE, expert_qtype=GGMLQuantizationType.Q8_0)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    model = write_moe_gguf(tmp_path_factory.mktemp("moe") / "moe.gguf", SPEC)
    # no read-ahead: every byte read is then a miss's (read-aheads count their bytes too)
    args = ["-m", str(model), "--experts", "disk", "--expert-slots", "2"]
    args += ["--expert-prefetch", "off"]
    with serve_process(args, tmp_path_factory.mktemp("serve-moe")) as (url, _):
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
    assert set(before) == {"lookups", "hits", "misses", "bytes_read", "stall_seconds"}
    body = {"prompt": "hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = httpx.post(base + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    after = _experts(base)
    lookups = after["lookups"] - before["lookups"]
    tokens = r.json()["usage"]["prompt_tokens"] + 6
    # Every layer routes each token to n_used experts; the forward of the last token is not run.
    assert SPEC.n_layers * SPEC.n_used <= lookups <= SPEC.n_layers * SPEC.n_used * tokens
    assert after["hits"] + after["misses"] == after["lookups"]
    per_expert = SPEC.expert_nbytes // (SPEC.n_layers * SPEC.n_expert)
    assert after["bytes_read"] == after["misses"] * per_expert > 0
