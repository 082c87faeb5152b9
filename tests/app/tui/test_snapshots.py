"""Snapshots (pytest-textual-snapshot) of the chat and model screens and the settings dialog at
80x24, with fixed content: a fake backend, fixed memory figures and fixed generation figures.
Update with --snapshot-update after checking the SVG by eye."""

import pytest
from textual.widgets import DataTable, Input

from localllm.app.tui.backend import GenSettings
from localllm.app.tui.config import TuiConfig
from localllm.app.tui.screens.modals import SamplingModal
from localllm.app.tui.stats import GenStats
from localllm.app.tui.widgets.prompt import PromptInput
from tests.app.tui.fakes import FakeBackend, make_app, wait_for
from tests.app.tui.test_chat_screen import answered, ready, send
from tests.app.tui.test_model_screen import tiny_gguf

ANSWER = """Here is a **Python** example:

```python
def greet(name):
    return f"Hello, {name}!"
```

- short
- and *sweet*
"""


def test_chat_screen_80x24(snap_compare, tmp_path):
    app = make_app(tmp_path, FakeBackend([ANSWER], name="tiny-chat"))

    async def run_before(pilot) -> None:
        await ready(pilot)
        await send(pilot, "Show me a greeting function")
        await answered(pilot, 2)
        chat = pilot.app.chat
        chat.stats = GenStats(0.0, 1.0, 3.0, prompt_tokens=30, completion_tokens=41)
        chat.refresh_status()
        pilot.app.clear_notifications()
        prompt = chat.query_one(PromptInput)
        prompt.cursor_blink = False  # a blinking cursor would make the picture flaky
        prompt.value = "next question"
        prompt.cursor_position = len(prompt.value)
        await pilot.pause()

    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


def test_model_screen_80x24(snap_compare, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    tiny_gguf(models / "small-chat.gguf", 2, 4, 2, 64, 256)
    tiny_gguf(models / "huge-moe.gguf", 200, 64, 64, 16384, 131072)
    config = TuiConfig(model_dirs=(models,))
    app = make_app(tmp_path, FakeBackend(["a"], name="small-chat"), config=config)

    async def run_before(pilot) -> None:
        await ready(pilot)
        await pilot.press("ctrl+l")
        table = pilot.app.screen.query_one("#library-table", DataTable)
        await wait_for(pilot, lambda: table.row_count == 2)
        pilot.app.clear_notifications()
        await pilot.pause()

    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


@pytest.mark.anyio
async def test_theme_toggle_and_palette_commands(tmp_path):
    app = make_app(tmp_path, FakeBackend(["a"]))
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        assert app.theme == "textual-dark"
        await pilot.press("ctrl+t")
        assert app.theme == "textual-light"
        titles = [c.title for c in app.get_system_commands(app.screen)]
        for want in ("New chat", "Models", "Regenerate", "Export conversation", "Unload model"):
            assert want in titles
        # 80 columns: the conversation list starts hidden, ctrl+b shows it.
        side = app.chat.query_one("#side")
        assert not side.display
        await pilot.press("ctrl+b")
        assert side.display


def test_settings_dialog_80x24(snap_compare, tmp_path):
    settings = GenSettings(system_prompt="Be brief.", temperature=0.7, top_p=0.9, max_tokens=321)
    app = make_app(tmp_path, FakeBackend(["a"]), config=TuiConfig(sampling=settings))

    async def run_before(pilot) -> None:
        await ready(pilot)
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, SamplingModal))
        for field in pilot.app.screen.query(Input):
            field.cursor_blink = False  # a blinking cursor would make the picture flaky
        await pilot.pause()

    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)
