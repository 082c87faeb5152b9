"""32 simultaneous streaming clients (openai's AsyncOpenAI) against the real server.

Each stream must equal the same request made without streaming (greedy), with chunks of one id
only; then half of 32 streams hang up after a few chunks: the rest still complete correctly,
the abandoned ones are aborted, and /metrics shows nothing running and the KV cache back at
its idle usage. Prompts are counting sequences: distinct per client, and their greedy
continuation has wide logit margins (over 0.4 nats a token, one sequence at a time), so batch
composition cannot flip a token. Two starts of the stride are left out for their narrow ones:
320 (0.055: " 327" instead of " 326" in some batches) and 661 (0.186).
"""

import asyncio

import openai
import pytest

from tests.app.server.conftest import API_KEY
from tests.app.server.test_robustness import _wait_idle

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct.Q4_1"
CLIENTS = 32
STARTS = [s for s in (10 + 31 * i for i in range(CLIENTS + 2)) if s not in (320, 661)]
MAX_TOKENS = 12


def _prompt(start: int) -> str:
    return ", ".join(str(i) for i in range(start, start + 5)) + ","


def _client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0,
                              timeout=600)  # fmt: skip


async def _whole(client: openai.AsyncOpenAI, start: int) -> str:
    r = await client.completions.create(
        model=MODEL, prompt=_prompt(start), max_tokens=MAX_TOKENS, temperature=0
    )
    return r.choices[0].text


async def _streamed(
    client: openai.AsyncOpenAI, start: int, leave_after: int | None = None
) -> tuple[str, set[str]]:
    """The streamed text and chunk ids; with `leave_after`, hang up after that many chunks."""
    long = leave_after is not None  # the abandoned ones would run long: ignore_eos, no limit
    stream = await client.completions.create(
        model=MODEL, prompt=_prompt(start), temperature=0, stream=True,
        max_tokens=None if long else MAX_TOKENS, extra_body={"ignore_eos": long},
    )  # fmt: skip
    text, ids, n = "", set(), 0
    async with stream:
        async for chunk in stream:
            ids.add(chunk.id)
            text += "".join(c.text for c in chunk.choices)
            n += 1
            if leave_after is not None and n >= leave_after:
                break  # leaving the `async with` closes the connection
    return text, ids


@pytest.fixture(scope="module")
def expected(server) -> list[str]:
    async def go():
        async with _client(server) as client:
            return await asyncio.gather(*(_whole(client, s) for s in STARTS))

    texts = asyncio.run(go())
    for s, text in zip(STARTS, texts, strict=True):  # the references themselves are right
        assert text.startswith(f" {s + 5}, {s + 6},"), (s, text)
    return texts


def test_32_streams_equal_their_non_streamed_text(server, expected):
    async def go():
        async with _client(server) as client:
            return await asyncio.gather(*(_streamed(client, s) for s in STARTS))

    got = asyncio.run(go())
    assert [text for text, _ in got] == expected
    assert all(len(ids) == 1 for _, ids in got)  # one id per stream: nothing interleaved
    assert len({next(iter(ids)) for _, ids in got}) == CLIENTS


def test_half_hang_up_the_rest_complete_and_kv_is_freed(server, expected):
    before = _wait_idle(server)

    async def go():
        async with _client(server) as client:
            leave = [3 if i % 2 else None for i in range(CLIENTS)]
            return await asyncio.gather(
                *(_streamed(client, s, n) for s, n in zip(STARTS, leave, strict=True))
            )

    got = asyncio.run(go())
    kept = [text for i, (text, _) in enumerate(got) if i % 2 == 0]
    assert kept == expected[::2]
    after = _wait_idle(server)
    abort = 'vllm:request_success_total{finished_reason="abort"}'
    length = 'vllm:request_success_total{finished_reason="length"}'
    assert after[abort] - before[abort] == CLIENTS // 2
    assert after[length] - before[length] == CLIENTS // 2  # only the kept ones ran to the end
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:kv_cache_usage_perc"] == before["vllm:kv_cache_usage_perc"]
    assert after["localllm:kv_cache_free_blocks"] == before["localllm:kv_cache_free_blocks"]
