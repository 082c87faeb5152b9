"""The resource panel: memory figures rendered from a probe, the loaded model and its speed."""

import pytest

from localllm.app.tui.resources import Memory, available_for_model, probe_memory
from localllm.app.tui.widgets.resources import ResourcePanel, render_resources
from tests.app.tui.fakes import GB, FakeBackend, make_app
from tests.app.tui.test_chat_screen import answered, ready, send


def test_render_with_and_without_gpu():
    cpu = Memory(16 * GB, 12 * GB, GB)
    assert render_resources(cpu, None, 0, None, compact=False) == (
        "RAM 4.0 GB/16.0 GB ██░░░░░░░░\nGPU none\napp 1.0 GB\nmodel none\n-- tok/s"
    )
    gpu = Memory(16 * GB, 12 * GB, GB, "H200", 140 * GB, 70 * GB)
    assert render_resources(gpu, "qwen", 2 * GB, 41.25, compact=True) == (
        "RAM 4.0 GB/16.0 GB ██░░░░░░░░  GPU 70.0 GB/140.0 GB █████░░░░░  app 1.0 GB\n"
        "model qwen (2.0 GB)  41.2 tok/s"
    )
    assert available_for_model(cpu) == 12 * GB and available_for_model(gpu) == 70 * GB


def test_probe_reads_this_machine():
    mem = probe_memory()
    assert 0 < mem.ram_available <= mem.ram_total and mem.process_rss > 0


@pytest.mark.anyio
async def test_panel_shows_the_loaded_model_and_speed(tmp_path):
    app = make_app(tmp_path, FakeBackend(["one two three four"], chunk=2))
    async with app.run_test(size=(120, 30)) as pilot:
        await ready(pilot)
        await send(pilot, "hi")
        await answered(pilot, 2)
        panel = app.chat.query_one(ResourcePanel)
        panel.sample()
        text = str(panel.render())
        assert "model 123.5 KB\nfake-model\n" in text  # the name on a row of its own
        assert "RAM 6.0 GB/16.0 GB" in text
        speed = app.last_speed
        assert speed is not None and f"{speed:.1f} tok/s" in text
