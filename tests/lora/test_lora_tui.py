"""The TUI's load dialog takes `--lora PATH[:SCALE]` beside residency flags: Load hands them to
the real engine loader, and the loaded engine runs that adapter at that global scale."""

import shutil

import pytest
from textual.widgets import DataTable, Input

from localllm.app.tui.config import TuiConfig
from localllm.app.tui.loaders import engine_loader
from localllm.app.tui.screens.load_modal import LoadModal
from tests.app.tui.fakes import FakeBackend, make_app, wait_for
from tests.app.tui.test_chat_screen import ready
from tests.lora.lora_refs import HF, LORA

pytestmark = pytest.mark.anyio


async def test_load_dialog_loads_a_lora_adapter(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(HF / "llama.gguf", models / "llama.gguf")
    app = make_app(tmp_path, FakeBackend(["a"]), config=TuiConfig(model_dirs=(models,)))
    adapter = LORA / "llama-a.gguf"
    async with app.run_test(size=(110, 40)) as pilot:
        await ready(pilot)
        app.loader = engine_loader(max_num_seqs=1, max_model_len=128, kv_cache_dtype="f32")
        await pilot.press("ctrl+l")
        await wait_for(pilot, lambda: app.screen.query_one("#library-table", DataTable).row_count)
        app.screen.query_one("#library-table", DataTable).focus()
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, LoadModal))
        flags = app.screen.query_one("#flags", Input)
        flags.value = "--lora"  # a flag without its value: refused, nothing loads
        await pilot.click("#load")
        assert "--lora needs" in str(app.screen.query_one("#error").render())
        flags.value = f"--lora {adapter}:0.5"
        flags.focus()
        await pilot.press("enter")  # Enter in the flags loads, as the Load button does
        await wait_for(pilot, lambda: getattr(app.backend, "engine", None) is not None, 3000)
        loras = app.backend.engine.engine.loras
        assert [(a["path"], a["scale"]) for a in loras.describe()] == [(str(adapter), 0.5)]
        await pilot.press("ctrl+q")
