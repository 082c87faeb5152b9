"""What a newcomer sees at ordinary terminal sizes (issue 34): model names that do not break
mid-word, a remote model without a made-up size, conversation titles cut with an ellipsis, and
a side panel that follows the terminal's width."""

import pytest

from localllm.app.tui.history import conversation_title
from localllm.app.tui.screens.models import ModelScreen
from localllm.app.tui.widgets.resources import ResourcePanel
from tests.app.tui.fakes import FakeBackend, make_app, wait_for
from tests.app.tui.openai_fake import MODEL, FakeOpenAI, serving
from tests.app.tui.test_chat_screen import answered, ready, send
from tests.app.tui.test_endpoint_tui import endpoint_app

pytestmark = pytest.mark.anyio

LONG_NAME = "SmolLM2-135M-Instruct.Q4_1"  # the embedded model: longer than the side panel
STORY = "Please write me a long story about a dragon who learns to code in Python"


def seen(app, widget) -> list[str]:
    """The terminal's text over `widget`'s region, one string per row (trailing blanks cut)."""
    screen = [strip.text for strip in app.screen._compositor.render_strips()]
    r = widget.region
    return [row[r.x : r.right].rstrip() for row in screen[r.y : r.bottom]]


def panel_rows(app, panel: ResourcePanel) -> list[str]:
    panel.sample()  # the figures now, not at the next 2 s tick
    return [row.strip() for row in seen(app, panel)]


async def test_a_long_model_name_is_shortened_in_the_middle_not_wrapped(tmp_path):
    backend = FakeBackend(["ok"], name=LONG_NAME)
    backend.model_bytes = 98_362_432
    app = make_app(tmp_path, backend)
    async with app.run_test(size=(120, 30)) as pilot:
        await ready(pilot)
        panel = app.chat.query_one("#resources", ResourcePanel)
        await pilot.pause()
        rows = panel_rows(app, panel)
        await pilot.pause()
        rows = panel_rows(app, panel)
        i = rows.index("model 98.4 MB")
        name = rows[i + 1]  # the name on a row of its own, never a fragment of it below
        assert rows[i + 2] == "-- tok/s", rows
        assert "…" in name and len(name) <= panel.content_region.width, rows
        head, tail = name.split("…")
        assert LONG_NAME.startswith(head) and LONG_NAME.endswith(tail) and tail.endswith("Q4_1")
        assert len(head) >= 8, name


async def test_a_short_model_name_is_shown_whole(tmp_path):
    app = make_app(tmp_path, FakeBackend(["ok"], name="tiny-chat"))
    async with app.run_test(size=(120, 30)) as pilot:
        await ready(pilot)
        await pilot.pause()
        rows = panel_rows(app, app.chat.query_one("#resources", ResourcePanel))
        await pilot.pause()
        rows = panel_rows(app, app.chat.query_one("#resources", ResourcePanel))
        i = rows.index("model 123.5 KB")
        assert rows[i + 1] == "tiny-chat", rows


async def test_a_remote_model_shows_no_size(tmp_path):
    """Over --endpoint (a real server on a socket) the model's weights are not ours to count."""
    with serving(FakeOpenAI([{"content": "hi"}])) as fake:
        app = endpoint_app(tmp_path, fake.url)
        async with app.run_test(size=(120, 30)) as pilot:
            await wait_for(pilot, lambda: app.backend is not None, limit=1000)
            await pilot.pause()
            panel = app.chat.query_one("#resources", ResourcePanel)
            rows = panel_rows(app, panel)
            await pilot.pause()
            rows = panel_rows(app, panel)
            i = rows.index("model remote")
            assert rows[i + 1] == MODEL and not [r for r in rows if "0 B" in r], rows
            await pilot.press("ctrl+l")
            await wait_for(pilot, lambda: isinstance(app.screen, ModelScreen))
            compact = app.screen.query_one(ResourcePanel)
            await pilot.pause()
            text = " ".join(panel_rows(app, compact))
            assert f"model {MODEL} (remote)" in text and "0 B" not in text, text


def test_a_long_first_message_makes_a_title_cut_at_a_word_with_an_ellipsis():
    assert conversation_title(STORY) == "Please write me a long story about a…"
    assert conversation_title("  two\n lines  ") == "two lines"  # one line in the list
    assert conversation_title("x" * 60) == "x" * 39 + "…"  # no space to cut at
    assert conversation_title("short question") == "short question"


async def test_a_title_wider_than_the_list_ends_with_an_ellipsis(tmp_path):
    app = make_app(tmp_path, FakeBackend(["ok"]))
    async with app.run_test(size=(120, 30)) as pilot:
        await ready(pilot)
        await send(pilot, STORY)
        await answered(pilot, 2)
        assert app.chat.conversation.title == conversation_title(STORY)
        await pilot.pause()
        rows = [r.strip() for r in seen(app, app.chat.query_one("#conversations"))]
        (row,) = [r for r in rows if r]
        assert row.endswith("…") and STORY.startswith(row[:-1]) and len(row) > 10, rows


async def test_the_side_panel_follows_the_terminal_width(tmp_path):
    app = make_app(tmp_path, FakeBackend(["ok"]))
    async with app.run_test(size=(120, 30)) as pilot:
        await ready(pilot)
        side = app.chat.query_one("#side")
        assert side.display
        await pilot.resize_terminal(90, 30)
        await pilot.pause()
        assert not side.display  # shrunk below 100 columns: hidden
        await pilot.press("ctrl+b")
        assert side.display  # the user may still open it
        await pilot.resize_terminal(95, 30)
        await pilot.pause()
        assert side.display  # and it stays open while the terminal stays narrow
        await pilot.resize_terminal(130, 30)
        await pilot.pause()
        await pilot.press("ctrl+b")
        assert not side.display  # closed by hand on a wide terminal
        await pilot.resize_terminal(140, 30)
        await pilot.pause()
        assert not side.display  # stays closed: the width did not cross 100
        await pilot.resize_terminal(80, 30)
        await pilot.pause()
        await pilot.resize_terminal(110, 30)
        await pilot.pause()
        assert side.display  # grown past 100 columns: shown


async def test_a_shrink_behind_another_screen_counts_when_the_chat_comes_back(tmp_path):
    app = make_app(tmp_path, FakeBackend(["ok"]))
    async with app.run_test(size=(120, 30)) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+l")
        await wait_for(pilot, lambda: isinstance(app.screen, ModelScreen))
        await pilot.resize_terminal(90, 30)
        await pilot.pause()
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is app.chat)
        await pilot.pause()
        assert not app.chat.query_one("#side").display
