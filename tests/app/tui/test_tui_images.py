"""Images in the TUI, driven with Textual's Pilot: `/image PATH`, a pasted (dropped) image path
and the palette's "Attach image" attach an image to the next message; it is sent with it, shown
as a chip in the transcript and kept in history. With the real engine and the Gemma 3 vision
fixture (tests/data/vision/*gemma3*) the answer equals the engine's own for the same image."""

import asyncio

import pytest
from textual import events

from localllm.app.tui.backend import GenSettings
from localllm.app.tui.config import TuiConfig
from localllm.app.tui.engine_backend import EngineBackend
from localllm.app.tui.images import parts, split_images
from localllm.app.tui.widgets.prompt import PromptInput
from localllm.engine import EngineArgs, LLMEngine
from localllm.media.vision.pipeline import VisionPipeline
from tests.app.tui.fakes import FakeBackend, make_app, wait_for
from tests.app.tui.test_chat_screen import ready, send, views
from tests.media.test_vision_gemma3 import MMPROJ, TEXT
from tests.media.vision_fixture import image_bytes, run_greedy

pytestmark = pytest.mark.anyio
QUESTION = "What is in this image?"
N = 8


@pytest.fixture
def picture(tmp_path):
    path = tmp_path / "my pic.png"  # a space: dropped paths come quoted or escaped
    path.write_bytes(image_bytes("tall.png"))
    return path


def _status(app) -> str:
    return str(app.chat.query_one("#status").render())


async def test_slash_image_attaches_to_the_next_message(tmp_path, picture):
    backend = FakeBackend(["A picture."])
    app = make_app(tmp_path, backend)
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await ready(pilot)
        await send(pilot, f"/image {picture}")
        await pilot.pause()
        assert chat.pending_images == [picture.resolve()]
        assert "my pic.png" in _status(app)
        await send(pilot, QUESTION)
        await wait_for(pilot, lambda: not chat.generating and len(chat.history) == 2)
        ((messages, _),) = backend.calls
        assert parts(messages)[-1]["content"] == [
            {"type": "image", "path": str(picture.resolve())},
            {"type": "text", "text": QUESTION},
        ]
        assert chat.pending_images == [] and "my pic.png" not in _status(app)
        (user, _answer) = views(app)
        assert user[0] == "user" and "🖼 `my pic.png`" in user[1] and QUESTION in user[1]
        stored = app.store.messages(chat.conversation.id)[0].content
        assert split_images(stored) == ([picture.resolve()], QUESTION)  # kept in history


async def test_a_dropped_image_path_attaches_it(tmp_path, picture):
    app = make_app(tmp_path, FakeBackend(["ok"]))
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await ready(pilot)
        prompt = chat.query_one(PromptInput)
        prompt.post_message(events.Paste(str(picture).replace(" ", "\\ ")))  # as terminals drop
        await wait_for(pilot, lambda: chat.pending_images == [picture.resolve()])
        assert prompt.value == ""  # not typed into the message
        prompt.post_message(events.Paste("just some text.png words"))  # not a file: typed
        await pilot.pause()
        assert chat.pending_images == [picture.resolve()]


async def test_bad_attachments_say_why(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    app = make_app(tmp_path, FakeBackend(["ok"]))
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await ready(pilot)
        assert not chat.attach_image(tmp_path / "notes.txt")
        assert not chat.attach_image(tmp_path / "missing.png")
        await pilot.pause()
        assert chat.pending_images == []
        assert any("not an image file" in str(n.message) for n in app._notifications)


async def test_palette_attach_image(tmp_path, picture):
    app = make_app(tmp_path, FakeBackend(["ok"]))
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await ready(pilot)
        chat.action_attach_image()
        await pilot.pause()
        app.screen.query_one("Input").value = str(picture)
        await pilot.press("enter")
        await wait_for(pilot, lambda: chat.pending_images == [picture.resolve()])


@pytest.fixture(scope="module")
def expected() -> str:
    engine = LLMEngine(str(TEXT), EngineArgs(max_num_seqs=1))
    vision = VisionPipeline(MMPROJ, engine)
    try:
        msgs = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": QUESTION}]}]  # fmt: skip
        ids, mm = vision.chat(engine, msgs, [vision.prepare(image_bytes("tall.png"))])
        _, out = run_greedy(engine, ids, mm, N)
        return out.outputs[0].text
    finally:
        vision.close()
        engine.close()


async def test_the_real_engine_sees_the_attached_image(tmp_path, picture, expected):
    backend = await asyncio.to_thread(EngineBackend.load, TEXT, MMPROJ, max_num_seqs=1)

    async def load(name, residency=None):
        return backend

    app = make_app(tmp_path, config=TuiConfig(sampling=GenSettings(temperature=0.0, max_tokens=N)))
    app.loader = load
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.backend is backend, limit=3000)
        chat = app.chat
        await send(pilot, f"/image '{picture}'")
        await send(pilot, QUESTION)
        await wait_for(pilot, lambda: not chat.generating and len(chat.history) == 2, limit=6000)
        assert chat.history[1].content == expected
        await pilot.press("ctrl+r")  # answered again from history: the image is still there
        await wait_for(pilot, lambda: not chat.generating and len(chat.history) == 2, limit=6000)
        assert chat.history[1].content == expected
        await pilot.press("ctrl+q")


async def test_a_text_only_model_refuses_an_image_clearly(tmp_path, picture):
    backend = await asyncio.to_thread(EngineBackend.load, TEXT, None, max_num_seqs=1)

    async def load(name, residency=None):
        return backend

    app = make_app(tmp_path, config=TuiConfig(sampling=GenSettings(temperature=0.0, max_tokens=2)))
    app.loader = load
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.backend is backend, limit=3000)
        chat = app.chat
        chat.attach_image(picture)
        await send(pilot, QUESTION)
        await wait_for(pilot, lambda: not chat.generating, limit=6000)
        await pilot.pause()
        notes = [str(n.message) for n in app._notifications]
        assert any("cannot see images" in n and "--mmproj" in n for n in notes), notes
        await pilot.press("ctrl+q")


async def test_the_loader_pairs_mmproj_with_the_named_model_only(tmp_path):
    """`localllm -m MODEL --mmproj FILE`: that model gets the projector; a local file loaded
    later gets none (nothing is guessed from the files beside it)."""
    from localllm.app.tui.loaders import engine_loader

    copy = tmp_path / "other.gguf"
    copy.write_bytes(TEXT.read_bytes())
    load = engine_loader((str(TEXT), str(MMPROJ)), max_num_seqs=1)
    paired, alone = await load(str(TEXT)), await load(str(copy))
    try:
        assert paired.vision is not None and paired.vision.kind == "gemma3"
        assert alone.vision is None
    finally:
        await paired.close()
        await alone.close()
