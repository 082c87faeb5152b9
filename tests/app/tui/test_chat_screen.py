"""Pilot tests of the chat screen with a fake backend: stream, stop, regenerate, edit, history."""

import pytest

from localllm.app.tui.screens.chat import ChatScreen
from localllm.app.tui.widgets.message import MessageView
from localllm.app.tui.widgets.prompt import PromptInput
from tests.app.tui.fakes import FakeBackend, make_app, wait_for

pytestmark = pytest.mark.anyio


async def send(pilot, text: str) -> None:
    pilot.app.screen.query_one(PromptInput).value = text
    await pilot.press("enter")


def views(app) -> list[tuple[str, str]]:
    return [(v.role, v.markdown.source) for v in app.screen.query(MessageView)]


async def ready(pilot) -> ChatScreen:
    await wait_for(pilot, lambda: pilot.app.backend is not None)
    return pilot.app.screen


async def answered(pilot, n: int) -> None:
    chat = pilot.app.screen
    await wait_for(pilot, lambda: not chat.generating and len(chat.history) >= n)


async def test_send_streams_answer_and_commits_both_messages(tmp_path):
    backend = FakeBackend(["Hello **world**, fine."])
    app = make_app(tmp_path, backend)
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await ready(pilot)
        await send(pilot, "hi there")
        await answered(pilot, 2)
        assert views(app) == [("user", "hi there"), ("assistant", "Hello **world**, fine.")]
        assert backend.calls[0][0] == [{"role": "user", "content": "hi there"}]
        stored = app.store.messages(chat.conversation.id)
        assert [(m.role, m.content, m.finish_reason) for m in stored] == [
            ("user", "hi there", None),
            ("assistant", "Hello **world**, fine.", "stop"),
        ]
        assert stored[1].completion_tokens == 8  # 22 chars in 3-char pieces
        status = str(chat.query_one("#status").render())
        assert "fake-model" in status and "ctx 16/2048" in status
        assert chat.conversation.title == "hi there"


async def test_stop_keeps_the_partial_answer(tmp_path):
    backend = FakeBackend(["abcdefghi"], hold=True)
    app = make_app(tmp_path, backend)
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await ready(pilot)
        await send(pilot, "go")
        await wait_for(pilot, lambda: any(v[1] == "abc" for v in views(app)))
        assert chat.generating
        await pilot.press("escape")
        await answered(pilot, 2)
        assert views(app) == [("user", "go"), ("assistant", "abc")]
        stored = app.store.messages(chat.conversation.id)
        assert [(m.content, m.finish_reason) for m in stored] == [("go", None), ("abc", "abort")]
        label = chat.query(MessageView).last().query_one(".role").render()
        assert "stopped" in str(label)


async def test_regenerate_replaces_the_last_answer(tmp_path):
    backend = FakeBackend(["first answer", "second answer"])
    app = make_app(tmp_path, backend)
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await ready(pilot)
        await send(pilot, "question")
        await answered(pilot, 2)
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: views(app)[-1] == ("assistant", "second answer"))
        await answered(pilot, 2)
        assert views(app) == [("user", "question"), ("assistant", "second answer")]
        # The regenerated request saw only the user message, not the discarded answer.
        assert backend.calls[1][0] == [{"role": "user", "content": "question"}]
        stored = app.store.messages(chat.conversation.id)
        assert [m.content for m in stored] == ["question", "second answer"]


async def test_edit_and_resend_the_last_user_message(tmp_path):
    backend = FakeBackend(["one", "two", "three"])
    app = make_app(tmp_path, backend)
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await ready(pilot)
        await send(pilot, "first")
        await answered(pilot, 2)
        await send(pilot, "secnd")
        await answered(pilot, 4)
        await pilot.press("ctrl+e")
        prompt = chat.query_one(PromptInput)
        assert prompt.value == "secnd" and prompt.has_class("editing")
        await send(pilot, "second")
        await answered(pilot, 4)
        assert views(app) == [
            ("user", "first"),
            ("assistant", "one"),
            ("user", "second"),
            ("assistant", "three"),
        ]
        assert backend.calls[2][0][-1] == {"role": "user", "content": "second"}
        assert len(backend.calls[2][0]) == 3
        stored = app.store.messages(chat.conversation.id)
        assert [m.content for m in stored] == ["first", "one", "second", "three"]


async def test_copy_takes_the_last_code_block(tmp_path):
    answer = "Try:\n\n```sh\nls -la\n```\n\nthen\n\n```python\nprint('hi')\n```\n"
    app = make_app(tmp_path, FakeBackend([answer, "no code here"]))
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        await send(pilot, "how?")
        await answered(pilot, 2)
        await pilot.press("ctrl+y")
        assert app.clipboard == "print('hi')\n"
        await send(pilot, "again")
        await answered(pilot, 4)
        await pilot.press("ctrl+y")
        assert app.clipboard == "no code here"
