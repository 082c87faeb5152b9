"""No request holds the server's event loop: tokenizing, template rendering and oversized bodies
run elsewhere or are refused by size first, so /health keeps answering meanwhile.

Before the fix a 2 MB /tokenize froze /health for 2-9 s and a 7 MB chat for 12 s: tokenizers'
single-text encode held the GIL, and the chat template rendered on the loop.
"""

import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.slow

WORDS = "The quick brown fox jumps over the lazy dog, 1234 times; ünïcödé ✓. "


def _text(chars: int) -> str:
    return (WORDS * (chars // len(WORDS) + 1))[:chars]


def test_health_answers_within_a_second_while_heavy_requests_run(roomy_server):
    base = roomy_server.base
    results: dict[str, httpx.Response] = {}

    def post(name: str, path: str, body: dict) -> None:
        results[name] = httpx.post(base + path, json=body, timeout=300)

    big_chat = [{"role": "user", "content": _text(6_000_000)}]
    # Under the size bound (8192 tokens x the longest token): rendered and tokenized in full.
    long_chat = [{"role": "user", "content": _text(600_000)}]
    work = [
        ("tokenize", "/tokenize", {"content": _text(2_000_000)}),
        ("big", "/v1/chat/completions", {"messages": big_chat}),
        ("long", "/v1/chat/completions", {"messages": long_chat, "max_tokens": 4}),
    ]
    heavy = [threading.Thread(target=post, args=args) for args in work]
    latencies = []
    with httpx.Client(base_url=base, timeout=30) as health:
        health.get("/health")  # a warm connection: time the answer, not the connect
        for t in heavy:
            t.start()
        while any(t.is_alive() for t in heavy):
            t0 = time.perf_counter()
            assert health.get("/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.05)
    for t in heavy:
        t.join()

    # The heavy requests did their work (or were refused for their size, not for a crash).
    tok = results["tokenize"]
    assert tok.status_code == 200, tok.text
    assert len(tok.json()["tokens"]) > 400_000
    big = results["big"]
    assert big.status_code == 400 and big.json()["error"]["code"] == "context_length_exceeded"
    long = results["long"]
    assert long.status_code == 400, long.text
    assert "does not fit the context" in long.json()["error"]["message"]
    assert len(latencies) >= 5, latencies  # the heavy work really overlapped the polling
    assert max(latencies) < 1.0, f"/health took {max(latencies):.2f} s"
