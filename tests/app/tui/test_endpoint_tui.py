"""The TUI over `--endpoint` against a real HTTP server on a real socket: a reasoning model's
`reasoning_content` is shown and saved with the answer, and ctrl+q mid-answer exits cleanly."""

import pytest

from localllm.app.tui.backend import GenSettings
from localllm.app.tui.endpoint_backend import EndpointBackend
from localllm.app.tui.loaders import endpoint_loader
from localllm.app.tui.widgets.message import MessageView
from tests.app.tui.fakes import make_app, wait_for
from tests.app.tui.openai_fake import MODEL, FakeOpenAI, serving
from tests.app.tui.test_chat_screen import send

pytestmark = pytest.mark.anyio

REASONING = [{"reasoning_content": "The user asks "}, {"reasoning_content": "for a capital."}]
ANSWER = [{"content": "Paris"}, {"content": " is the capital."}]


def endpoint_app(tmp_path, url: str):
    app = make_app(tmp_path)
    app.loader = endpoint_loader(url)
    return app


def last_view(app) -> MessageView:
    return app.chat.query(MessageView).last()


async def test_endpoint_backend_streams_reasoning_deltas():
    deltas = [{"reasoning_content": "a"}, {"reasoning": "b"}, {"content": "c"}]
    with serving(FakeOpenAI(deltas)) as fake:
        backend = await EndpointBackend(fake.url).connect()
        try:
            got = [
                d async for d in backend.stream([{"role": "user", "content": "q"}], GenSettings())
            ]
        finally:
            await backend.close()
    assert [(d.reasoning, d.text) for d in got if d.reasoning or d.text] == [
        ("a", ""),
        ("b", ""),
        ("", "c"),
    ]
    assert backend.name == MODEL


async def test_reasoning_is_shown_and_saved_with_the_answer(tmp_path):
    with serving(FakeOpenAI(REASONING + ANSWER)) as fake:
        app = endpoint_app(tmp_path, fake.url)
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: app.backend is not None, limit=1000)
            await send(pilot, "Capital of France?")
            chat = app.chat
            await wait_for(pilot, lambda: not chat.generating and len(chat.history) == 2)
            view = last_view(app)
            assert view.think.source == "The user asks for a capital."
            assert view.think.display
            assert view.markdown.source == "Paris is the capital."
            (_user, answer) = app.store.messages(chat.conversation.id)
            assert (answer.content, answer.reasoning, answer.finish_reason) == (
                "Paris is the capital.",
                "The user asks for a capital.",
                "stop",
            )
            # The next turn sends the answer back, not the reasoning (OpenAI's convention).
            await send(pilot, "And Spain?")
            await wait_for(pilot, lambda: not chat.generating and len(chat.history) == 4)
            assert fake.requests[1]["messages"][1] == {
                "role": "assistant",
                "content": "Paris is the capital.",
            }
            # Reopened from the history, the think block is there again.
            await chat.open(app.store.conversation(chat.conversation.id))
            await pilot.pause()
            assert last_view(app).think.source == "The user asks for a capital."


async def test_an_answer_that_is_all_reasoning_is_saved(tmp_path):
    """max_tokens ran out while the model was still thinking: no content at all."""
    with serving(FakeOpenAI(REASONING, finish="length")) as fake:
        app = endpoint_app(tmp_path, fake.url)
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: app.backend is not None, limit=1000)
            await send(pilot, "Capital of France?")
            chat = app.chat
            await wait_for(pilot, lambda: not chat.generating and len(chat.history) == 2)
            (_user, answer) = app.store.messages(chat.conversation.id)
            assert (answer.content, answer.reasoning, answer.finish_reason) == (
                "",
                "The user asks for a capital.",
                "length",
            )
            assert last_view(app).think.source == "The user asks for a capital."


async def test_quit_mid_answer_over_an_endpoint_saves_and_exits_0(tmp_path):
    with serving(FakeOpenAI(REASONING + ANSWER, hold_after=3)) as fake:
        app = endpoint_app(tmp_path, fake.url)
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: app.backend is not None, limit=1000)
            await send(pilot, "Capital of France?")
            chat = app.chat
            await wait_for(pilot, lambda: chat.generating and last_view(app).markdown.source)
            conversation = chat.conversation.id
            await pilot.press("ctrl+q")
            await wait_for(pilot, lambda: app.return_code is not None, limit=1000)
        assert app.return_code == 0
        assert fake.disconnected.wait(5)  # the request was dropped, so the server stops too
    (_user, answer) = app.store.messages(conversation)
    assert (answer.content, answer.reasoning, answer.finish_reason) == (
        "Paris",
        "The user asks for a capital.",
        "abort",
    )
