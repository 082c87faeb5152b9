"""AsyncEngine on the real SmolLM2: concurrent streams equal the sync engine, deltas add up,
leaving a stream aborts it, a bad request fails alone, shutdown finishes or aborts work."""

import asyncio

import pytest

from localllm.engine import LLM, AsyncEngine, SamplingParams
from localllm.engine.async_engine import EngineDeadError
from tests.engine.engine_fixtures import PROMPTS, greedy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(smollm2_path):
    eng = AsyncEngine.from_model(str(smollm2_path), max_num_seqs=8)
    yield eng
    eng.shutdown()


async def _collect(eng, prompt, params, rid=None):
    text, ids, last = "", [], None
    async for out in eng.generate(prompt, params, rid):
        for c in out.outputs:
            text += c.text
            ids += c.token_ids
        last = out
    return text, ids, last


def test_concurrent_streams_match_sync(smollm2_path):
    # Requests reach the engine thread at different steps, so batch compositions differ from the
    # sync run; precise mode computes every row the same way whatever the batch (the default CPU
    # int4 path does not, see test_engine_batching's near-tie check).
    eng = AsyncEngine.from_model(str(smollm2_path), precise=True)

    async def main():
        jobs = [_collect(eng, p, greedy(12)) for p in PROMPTS[:6]]
        return await asyncio.gather(*jobs)

    try:
        results = asyncio.run(main())
    finally:
        eng.shutdown()
    with LLM(str(smollm2_path), precise=True) as llm:
        want = llm.generate(PROMPTS[:6], greedy(12))
    for (text, ids, last), w in zip(results, want, strict=True):
        assert last.finished and last.outputs[0].finish_reason == "length"
        assert ids == w.outputs[0].token_ids
        assert text == w.outputs[0].text
        assert last.usage.completion_tokens == 12


def test_leaving_the_stream_aborts(engine):
    async def main():
        seen = 0
        async for _ in engine.generate(PROMPTS[4], greedy(500), "leaver"):
            seen += 1
            if seen == 3:
                break
        # The engine drops it and keeps serving.
        for _ in range(200):
            if "leaver" not in engine.engine.groups:
                break
            await asyncio.sleep(0.01)
        assert "leaver" not in engine.engine.groups
        return await _collect(engine, PROMPTS[0], greedy(4))

    _text, ids, last = asyncio.run(main())
    assert len(ids) == 4 and last.finished


def test_abort_by_id_and_bad_request_alone(engine):
    async def main():
        async def victim():
            return await _collect(engine, PROMPTS[4], greedy(400), "victim")

        task = asyncio.create_task(victim())
        good = asyncio.create_task(_collect(engine, PROMPTS[0], greedy(8)))
        await asyncio.sleep(0.3)
        engine.abort("victim")
        with pytest.raises(ValueError, match="does not fit"):
            await _collect(engine, list(range(3, 3 + engine.max_model_len)), greedy(2))
        return await task, await good

    (_vtext, vids, vlast), (_gtext, gids, glast) = asyncio.run(main())
    assert vlast.finished and vlast.outputs[-1].finish_reason == "abort" and len(vids) < 400
    assert len(gids) == 8 and glast.outputs[-1].finish_reason == "length"


def test_shutdown_lets_work_finish_or_aborts(smollm2_path):
    eng = AsyncEngine.from_model(str(smollm2_path))

    async def main():
        task = asyncio.create_task(_collect(eng, PROMPTS[1], greedy(10)))
        await asyncio.sleep(0.05)
        await asyncio.to_thread(eng.shutdown, False)
        result = await task
        with pytest.raises(EngineDeadError):
            await _collect(eng, PROMPTS[0], greedy(2))
        return result

    _text, ids, last = asyncio.run(main())
    assert len(ids) == 10 and last.outputs[-1].finish_reason == "length"

    eng2 = AsyncEngine.from_model(str(smollm2_path))

    async def main2():
        # shut down once the request decodes (a fixed sleep raced its admission on a loaded
        # machine: a request not yet admitted fails with EngineDeadError instead)
        decoding = asyncio.Event()

        async def run():
            ids, last = [], None
            async for out in eng2.generate(PROMPTS[1], greedy(400)):
                ids += [t for c in out.outputs for t in c.token_ids]
                last = out
                decoding.set()
            return ids, last

        task = asyncio.create_task(run())
        await asyncio.wait_for(decoding.wait(), timeout=120)
        await asyncio.to_thread(eng2.shutdown, True)
        return await task

    ids2, last2 = asyncio.run(main2())
    assert last2.outputs[-1].finish_reason == "abort" and 0 < len(ids2) < 400


def test_sampling_params_default(engine):
    # vLLM's defaults: temperature 1, max_tokens 16
    _, ids, _last = asyncio.run(_collect(engine, PROMPTS[0], SamplingParams(ignore_eos=True)))
    assert len(ids) == 16
