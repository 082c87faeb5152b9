"""End to end with the real tiny engine (SmolLM2-135M): the TUI's streamed answer equals the
engine's own greedy output for the same conversation."""

import asyncio

import pytest

from localllm.app.tui.backend import GenSettings
from localllm.app.tui.config import TuiConfig
from localllm.app.tui.engine_backend import EngineBackend
from localllm.engine.sampling.params import SamplingParams
from tests.app.tui.fakes import make_app, wait_for
from tests.app.tui.test_chat_screen import send, views

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


async def test_tui_streams_the_engines_greedy_answer(tmp_path, smollm2_path):
    backend = await asyncio.to_thread(
        EngineBackend.load, smollm2_path, max_num_seqs=1, max_model_len=512
    )
    question = "What is the capital of France?"
    ids = backend.engine.engine.chat_prompt([{"role": "user", "content": question}])
    reference = ""
    async for out in backend.engine.generate(ids, SamplingParams(temperature=0, max_tokens=8)):
        reference += out.outputs[0].text
    assert reference.strip()

    async def load(name):
        return backend

    settings = GenSettings(temperature=0.0, max_tokens=8)
    app = make_app(tmp_path, config=TuiConfig(sampling=settings))
    app.loader = load
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.backend is backend, limit=3000)
        await send(pilot, question)
        chat = app.chat
        await wait_for(pilot, lambda: not chat.generating and len(chat.history) == 2, limit=6000)
        assert views(app) == [("user", question), ("assistant", reference)]
        (_user, answer) = app.store.messages(chat.conversation.id)
        assert (answer.content, answer.completion_tokens) == (reference, 8)
        assert answer.prompt_tokens == len(ids)
        await pilot.press("ctrl+q")
    assert not backend.engine.alive  # quitting shut the engine thread down


async def test_quit_mid_answer_keeps_the_engines_partial_answer(tmp_path, smollm2_path):
    backend = await asyncio.to_thread(
        EngineBackend.load, smollm2_path, max_num_seqs=1, max_model_len=512
    )

    async def load(name):
        return backend

    settings = GenSettings(temperature=0.0, max_tokens=400)
    app = make_app(tmp_path, config=TuiConfig(sampling=settings))
    app.loader = load
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.backend is backend, limit=3000)
        await send(pilot, "Write a long story about a dragon.")
        chat = app.chat
        await wait_for(pilot, lambda: len(views(app)) == 2 and views(app)[1][1], limit=6000)
        conversation = chat.conversation.id
        await pilot.press("ctrl+q")
        await wait_for(pilot, lambda: app.return_code is not None, limit=6000)
    assert app.return_code == 0
    (_user, answer) = app.store.messages(conversation)
    assert answer.finish_reason == "abort"
    assert answer.content and 0 < answer.completion_tokens < 400
    assert not backend.engine.alive
