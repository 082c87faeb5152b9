"""Pilot tests of the app's edges: a message sent while the model loads, quitting mid-answer and
mid-load, and the settings dialog at small and large terminal sizes."""

import asyncio
import queue
import threading

import pytest

from localllm.app.tui.backend import GenSettings
from localllm.app.tui.config import TuiConfig
from localllm.app.tui.engine_backend import EngineBackend
from localllm.app.tui.loaders import engine_loader, in_daemon_thread
from localllm.app.tui.screens.modals import SamplingModal
from tests.app.tui.fakes import FakeBackend, make_app, wait_for
from tests.app.tui.test_chat_screen import answered, ready, send, views


def status(app) -> str:
    return str(app.chat.query_one("#status").render())


def gated_loader(backend: FakeBackend, gate: asyncio.Event, fail: bool = False):
    """A loader that finishes (or fails) only when `gate` is set."""

    async def load(name, residency=None):
        await gate.wait()
        if fail:
            raise RuntimeError("no such model")
        return backend

    load.local, load.device = True, "cpu"
    return load


@pytest.mark.anyio
async def test_a_message_sent_while_loading_is_answered_when_ready(tmp_path):
    backend = FakeBackend(["queued answer"])
    gate = asyncio.Event()
    app = make_app(tmp_path)
    app.loader = gated_loader(backend, gate)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.model_state.startswith("loading"))
        await send(pilot, "hello while loading")
        chat = app.chat
        assert chat.query_one("#prompt").value == ""  # taken, not left in the box
        assert views(app) == [("user", "hello while loading")]
        assert "queued" in status(app)
        stored = app.store.messages(chat.conversation.id)
        assert [(m.role, m.content) for m in stored] == [("user", "hello while loading")]
        assert backend.calls == []
        gate.set()
        await wait_for(pilot, lambda: app.backend is backend)
        await answered(pilot, 2)
        assert views(app) == [("user", "hello while loading"), ("assistant", "queued answer")]
        assert backend.calls[0][0] == [{"role": "user", "content": "hello while loading"}]
        stored = app.store.messages(chat.conversation.id)
        assert [(m.role, m.content) for m in stored][-1] == ("assistant", "queued answer")
        assert "queued" not in status(app)


@pytest.mark.anyio
async def test_a_queued_message_waits_when_the_load_fails(tmp_path):
    gate = asyncio.Event()
    app = make_app(tmp_path)
    app.loader = gated_loader(FakeBackend(["x"]), gate, fail=True)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.model_state.startswith("loading"))
        await send(pilot, "hello")
        gate.set()
        await wait_for(pilot, lambda: app.model_state == "no model")
        await pilot.pause()
        assert "queued" not in status(app)
        assert views(app) == [("user", "hello")]  # kept: ctrl+r answers it once a model loads
        assert not app.chat.generating


@pytest.mark.anyio
async def test_quit_mid_answer_saves_the_partial_answer_and_exits_0(tmp_path):
    backend = FakeBackend(["abcdefghi"], hold=True)
    app = make_app(tmp_path, backend)
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await ready(pilot)
        await send(pilot, "go")
        await wait_for(pilot, lambda: any(v[1] == "abc" for v in views(app)))
        conversation = chat.conversation.id
        await pilot.press("ctrl+q")
        await wait_for(pilot, lambda: app.return_code is not None)
    assert app.return_code == 0
    stored = app.store.messages(conversation)
    assert [(m.content, m.finish_reason) for m in stored] == [("go", None), ("abc", "abort")]
    assert backend.closed


def test_quit_during_a_model_load_exits_at_once(tmp_path, smollm2_path, monkeypatch):
    """The real loader, the real `App.run` (its event loop closes as `localllm` exits): a load
    still running in its thread must not hold the exit until it ends."""
    started, release = threading.Event(), threading.Event()

    def slow_load(cls, path, **engine_args):  # stands for minutes of reading weights
        started.set()
        release.wait(60)
        raise RuntimeError("load released")

    monkeypatch.setattr(EngineBackend, "load", classmethod(slow_load))
    app = make_app(tmp_path, model=str(smollm2_path))
    app.loader = engine_loader(max_num_seqs=1)

    async def quit_while_loading(pilot) -> None:
        await wait_for(pilot, started.is_set, limit=3000)
        await pilot.press("ctrl+q")

    safety = threading.Timer(15, release.set)  # a hung exit fails the test instead of the suite
    safety.start()
    try:
        app.run(headless=True, size=(80, 24), auto_pilot=quit_while_loading)
        returned_while_loading = not release.is_set()
    finally:
        release.set()
        safety.cancel()
    assert returned_while_loading
    assert app.return_code == 0


@pytest.mark.anyio
async def test_a_load_abandoned_by_quit_releases_what_it_loads_later():
    release, orphans = threading.Event(), queue.Queue()

    def load() -> str:
        release.wait(10)
        return "the loaded model"

    task = asyncio.create_task(in_daemon_thread(load, orphan=orphans.put))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()
    assert await asyncio.to_thread(orphans.get, timeout=10) == "the loaded model"


@pytest.mark.anyio
@pytest.mark.parametrize("size", [(80, 24), (140, 40)])
async def test_settings_dialog_shows_its_values(tmp_path, size):
    settings = GenSettings(system_prompt="Be brief.", temperature=0.7, top_p=0.9, max_tokens=321)
    app = make_app(tmp_path, FakeBackend(["a"]), config=TuiConfig(sampling=settings))
    async with app.run_test(size=size) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: isinstance(app.screen, SamplingModal))
        await pilot.pause()
        lines = [strip.text for strip in app.screen._compositor.render_strips()]
        for label, value in [
            ("System prompt", "Be brief."),
            ("Temperature", "0.7"),
            ("Top p", "0.9"),
            ("Max tokens", "321"),
        ]:
            assert any(label in line and value in line for line in lines), (label, lines)
        assert any("Save" in line for line in lines)
        await pilot.press("escape")
