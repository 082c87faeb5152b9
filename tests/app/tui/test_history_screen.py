"""Pilot tests of history in the chat screen: switch conversations, restart and find them, search,
rename, delete, export, per-conversation settings, and an app killed mid-answer."""

import os
import subprocess
import sys
import textwrap

import pytest
from textual.widgets import Input, ListView

from localllm.app.tui.history import HistoryStore
from localllm.app.tui.screens.modals import SamplingModal
from localllm.app.tui.widgets.sidebar import ConversationItem
from tests.app.tui.fakes import FakeBackend, make_app, wait_for
from tests.app.tui.test_chat_screen import answered, ready, send, views

pytestmark = pytest.mark.anyio


def titles(app) -> list[str]:
    return [i.conversation.title for i in app.screen.query(ConversationItem)]


async def test_switch_conversations_and_find_them_after_restart(tmp_path):
    path = tmp_path / "h.sqlite3"
    app = make_app(tmp_path, FakeBackend(["red", "blue", "green"]), store=HistoryStore(path))
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await ready(pilot)
        await send(pilot, "apples")
        await answered(pilot, 2)
        first = chat.conversation.id
        await pilot.press("ctrl+n")
        await send(pilot, "the sky")
        await answered(pilot, 2)
        await wait_for(pilot, lambda: titles(app) == ["the sky", "apples"])
        chat.query_one(ListView).focus()
        chat.query_one(ListView).index = 1
        await pilot.press("enter")
        await wait_for(pilot, lambda: chat.conversation.id == first)
        assert views(app) == [("user", "apples"), ("assistant", "red")]
        await send(pilot, "more")  # continues the reopened conversation with its history
        await answered(pilot, 4)
    app.store.close()

    again = make_app(tmp_path, FakeBackend(["x"]), store=HistoryStore(path))
    async with again.run_test(size=(100, 30)) as pilot:
        chat = await ready(pilot)
        await wait_for(pilot, lambda: titles(again) == ["apples", "the sky"])
        chat.query_one(ListView).focus()
        chat.query_one(ListView).index = 0
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(views(again)) == 4)
        assert views(again) == [
            ("user", "apples"),
            ("assistant", "red"),
            ("user", "more"),
            ("assistant", "green"),
        ]


async def test_search_rename_delete_export(tmp_path):
    store = HistoryStore(tmp_path / "h.sqlite3")
    for title, text in (("Cooking", "boil pasta"), ("Travel", "trains in Japan")):
        conv = store.new_conversation(title)
        store.add_message(conv.id, "user", text)
    app = make_app(tmp_path, FakeBackend(["ok"]), store=store)
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await ready(pilot)
        await wait_for(pilot, lambda: titles(app) == ["Travel", "Cooking"])
        chat.query_one("#search", Input).value = "pasta"
        await wait_for(pilot, lambda: titles(app) == ["Cooking"])
        chat.query_one(ListView).focus()
        chat.query_one(ListView).index = 0
        await pilot.press("enter")
        await wait_for(pilot, lambda: views(app) == [("user", "boil pasta")])
        await pilot.press("f2")
        modal_input = app.screen.query_one(Input)
        modal_input.value = "Pasta night"
        await pilot.press("enter")
        await wait_for(pilot, lambda: titles(app) == ["Pasta night"])
        await pilot.press("f3")
        exported = tmp_path / "pasta-night.md"
        await wait_for(pilot, exported.exists)
        assert exported.read_text() == "# Pasta night\n\n## User\n\nboil pasta\n"
        await pilot.press("f8", "y")
        chat.query_one("#search", Input).value = ""
        await wait_for(pilot, lambda: titles(app) == ["Travel"])
        assert [c.title for c in store.conversations()] == ["Travel"]
        assert views(app) == []


async def test_per_conversation_settings_are_used_and_saved(tmp_path):
    backend = FakeBackend(["a", "b"])
    app = make_app(tmp_path, backend)
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await ready(pilot)
        await send(pilot, "one")
        await answered(pilot, 2)
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, SamplingModal)
        app.screen.query_one("#system_prompt", Input).value = "You are a pirate."
        app.screen.query_one("#temperature", Input).value = "abc"
        await pilot.click("#save")
        assert "Temperature" in str(app.screen.query_one("#error").render())  # stays open
        app.screen.query_one("#temperature", Input).value = "0.25"
        app.screen.query_one("#max_tokens", Input).value = "64"
        app.screen.query_one("#max_tokens", Input).focus()
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.screen is chat)
        await send(pilot, "two")
        await answered(pilot, 4)
        messages, settings = backend.calls[-1]
        assert messages[0] == {"role": "system", "content": "You are a pirate."}
        assert (settings.temperature, settings.max_tokens) == (0.25, 64)
        saved = app.store.conversation(chat.conversation.id).settings
        assert (saved["temperature"], saved["system_prompt"]) == (0.25, "You are a pirate.")


def test_app_killed_mid_answer_loses_no_earlier_message(tmp_path):
    path = tmp_path / "h.sqlite3"
    script = textwrap.dedent(
        f"""
        import asyncio, os
        from pathlib import Path
        from tests.app.tui.fakes import FakeBackend, make_app, wait_for
        from tests.app.tui.test_chat_screen import answered, ready, send, views

        async def main():
            backend = FakeBackend(["first answer", "never finished"])
            app = make_app(Path({str(tmp_path)!r}), backend)
            async with app.run_test() as pilot:
                await ready(pilot)
                await send(pilot, "q1")
                await answered(pilot, 2)
                backend.hold = True
                await send(pilot, "q2")
                await wait_for(pilot, lambda: views(app)[-1] == ("assistant", "nev"))
                os._exit(9)  # killed while the answer streams

        asyncio.run(main())
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    env = dict(os.environ, PYTHONSAFEPATH="1", PYTHONPATH=root)  # for tests.app.tui.fakes
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, timeout=300)
    assert proc.returncode == 9
    store = HistoryStore(path)
    (conv,) = store.conversations()
    assert [(m.role, m.content) for m in store.messages(conv.id)] == [
        ("user", "q1"),
        ("assistant", "first answer"),
        ("user", "q2"),
    ]
