"""Images in the TUI, driven with Textual's Pilot: `/image PATH`, a pasted (dropped) image path
and the palette's "Attach image" attach an image to the next message; it is sent with it, shown
as a chip and a half-block preview in the transcript and kept in history as a copy (answered
again after the file moved). With the real engine and the Gemma 3 vision
fixture (tests/data/vision/*gemma3*) the answer equals the engine's own for the same image."""

import asyncio
import hashlib
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from textual import events

from localllm.app.tui.backend import GenSettings
from localllm.app.tui.config import TuiConfig
from localllm.app.tui.engine_backend import EngineBackend
from localllm.app.tui.images import parts, split_images
from localllm.app.tui.widgets.image_preview import COLS, ImagePreview, half_blocks, pixels
from localllm.app.tui.widgets.message import MessageView
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
        kept = _kept(app, picture)
        assert parts(messages)[-1]["content"] == [
            {"type": "image", "path": str(kept)},
            {"type": "text", "text": QUESTION},
        ]
        assert chat.pending_images == [] and "my pic.png" not in _status(app)
        (user, _answer) = views(app)
        assert user[0] == "user" and "🖼 `my pic.png`" in user[1] and QUESTION in user[1]
        stored = app.store.messages(chat.conversation.id)[0].content
        assert split_images(stored) == ([kept], QUESTION)  # kept in history, as a copy


def _kept(app, picture) -> Path:
    """Where the history keeps `picture`: its bytes under their SHA-256, its name kept."""
    data = picture.read_bytes()
    kept = app.store.path.parent / "images" / hashlib.sha256(data).hexdigest() / picture.name
    assert kept.read_bytes() == data
    return kept


async def test_a_sent_image_shows_a_half_block_preview(tmp_path):
    """A 4x4 picture (rows red, blue, green, white) fits the preview whole: 4 cells by 2, each
    the upper pixel in front of the lower one."""
    rows = [(255, 0, 0), (0, 0, 255), (0, 255, 0), (255, 255, 255)]
    path = tmp_path / "rows.png"
    Image.fromarray(np.array([[c] * 4 for c in rows], np.uint8)).save(path)
    app = make_app(tmp_path, FakeBackend(["Stripes."]))
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await ready(pilot)
        chat.attach_image(path)
        await send(pilot, QUESTION)
        await wait_for(pilot, lambda: not chat.generating and len(chat.history) == 2)
        (preview,) = app.screen.query(ImagePreview)
        await wait_for(pilot, lambda: preview.shown is not None)
        await pilot.pause()
        assert preview.shown.tolist() == [[list(c)] * 4 for c in rows]
        assert (preview.size.width, preview.size.height) == (4, 2)
        lines = half_blocks(preview.shown).split("\n")
        assert [ln.plain for ln in lines] == ["\u2580" * 4] * 2
        assert [s.style for s in lines[1].spans] == ["rgb(0,255,0) on rgb(255,255,255)"] * 4


def test_a_large_image_preview_fits_the_box(tmp_path):
    path = tmp_path / "wide.png"
    Image.new("RGB", (1200, 300), (10, 20, 30)).save(path)
    px = pixels(path)
    assert px.shape == (COLS * 300 // 1200, COLS, 3) and px[0, 0].tolist() == [10, 20, 30]
    assert pixels(path, 24, 4).shape == (6, 24, 3)
    assert half_blocks(px[:5]).plain.count("\n") == 2  # an odd last row: over black


async def test_an_unreadable_image_has_no_preview_but_its_chip(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        view = MessageView("user", f"[image: {tmp_path / 'gone.png'}]\nhi")
        await app.screen.query_one("#messages").mount(view)
        (preview,) = view.query(ImagePreview)
        await wait_for(pilot, lambda: not preview.display)
        assert "🖼 `gone.png`" in view.markdown.source


async def test_a_conversation_answered_again_after_the_file_moved(tmp_path, picture):
    backend = FakeBackend(["One.", "Two."])
    app = make_app(tmp_path, backend)
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await ready(pilot)
        await send(pilot, f"/image {picture}")
        await send(pilot, QUESTION)
        await wait_for(pilot, lambda: not chat.generating and len(chat.history) == 2)
        kept = _kept(app, picture)
        picture.rename(tmp_path / "moved.png")
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: len(backend.calls) == 2 and not chat.generating)
        again = parts(backend.calls[1][0])[-1]["content"][0]
        assert again == {"type": "image", "path": str(kept)} and kept.is_file()


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
        picture.unlink()  # the history keeps its own copy
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


async def test_deleting_a_conversation_deletes_the_images_only_it_kept(tmp_path, picture):
    """Two conversations share one image and one has its own: deleting that one (f8, y) removes
    its own copy; the shared one stays for the other conversation."""
    other = tmp_path / "other.png"
    other.write_bytes(image_bytes("wide.png"))
    backend = FakeBackend(["a", "b"])
    app = make_app(tmp_path, backend)
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await ready(pilot)
        await send(pilot, f"/image {picture}")
        await send(pilot, "first")
        await wait_for(pilot, lambda: not chat.generating and len(chat.history) == 2)
        shared = _kept(app, picture)
        await chat.open(None)  # a new conversation
        await send(pilot, f"/image {picture}")
        await send(pilot, f"/image {other}")
        await send(pilot, "second")
        await wait_for(pilot, lambda: not chat.generating and len(chat.history) == 2)
        own = _kept(app, other)
        old = 1_000_000  # both copies past the grace time
        for d in (shared.parent, own.parent):
            os.utime(d, (old, old))
        await pilot.press("f8", "y")
        await wait_for(pilot, lambda: not own.parent.exists())
        assert shared.is_file() and len(app.store.conversations()) == 1


def test_keeping_an_image_refuses_a_file_too_large_or_gone(tmp_path):
    from localllm.app.tui.images import MAX_IMAGE_BYTES, keep_image

    big = tmp_path / "big.png"
    with open(big, "wb") as f:
        f.truncate(MAX_IMAGE_BYTES + 1)  # sparse: its size is read, not its bytes
    with pytest.raises(ValueError, match=f"above the {MAX_IMAGE_BYTES} allowed"):
        keep_image(big, tmp_path / "images")
    with pytest.raises(ValueError, match="cannot read the attached image"):
        keep_image(tmp_path / "gone.png", tmp_path / "images")
    assert not (tmp_path / "images").exists()
