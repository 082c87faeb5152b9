"""Pilot tests of the model screen: library with fit verdicts, load and unload, Hub search with
monkeypatched search/pull, download progress, and pasted model references."""

from pathlib import Path

import numpy as np
import pytest
from textual import events
from textual.widgets import DataTable, Input

from localllm.app.hub import download as hub_download
from localllm.app.hub import search as hub_search
from localllm.app.hub.progress import Progress
from localllm.app.tui.config import TuiConfig
from localllm.app.tui.fit import DEFAULT_CONTEXT, OVERHEAD, fit, kv_bytes
from localllm.app.tui.screens.load_modal import LoadModal
from localllm.app.tui.screens.models import ModelScreen
from localllm.app.tui.widgets.download import DownloadRow
from localllm.app.tui.widgets.prompt import PromptInput
from tests.app.tui.fakes import GB, FakeBackend, make_app, wait_for
from tests.app.tui.test_chat_screen import ready
from tests.engine.gguf_fixtures import write_gguf
from tests.offload.tiny_moe import write_moe_gguf

pytestmark = pytest.mark.anyio


def tiny_gguf(path: Path, layers: int, heads: int, kv_heads: int, embd: int, ctx: int) -> Path:
    meta = {
        "llama.block_count": layers,
        "llama.attention.head_count": heads,
        "llama.attention.head_count_kv": kv_heads,
        "llama.embedding_length": embd,
        "llama.context_length": ctx,
    }
    w = np.arange(32, dtype=np.float32).reshape(4, 8)
    return write_gguf(path, meta, {"token_embd.weight": w}, arch="llama")


@pytest.fixture
def model_dir(tmp_path) -> Path:
    d = tmp_path / "models"
    d.mkdir()
    tiny_gguf(d / "small.gguf", 2, 4, 2, 64, 256)
    tiny_gguf(d / "huge.gguf", 200, 64, 64, 16384, 131072)
    return d


def test_kv_estimate_and_verdicts(model_dir):
    # 2 layers x 2 KV heads x (16 + 16) dims x 256 tokens x 2 bytes
    assert kv_bytes(model_dir / "small.gguf") == 2 * 2 * 32 * 256 * 2
    # context is capped at DEFAULT_CONTEXT: 200 x 64 x 512 x 8192 x 2
    assert kv_bytes(model_dir / "huge.gguf") == 200 * 64 * 512 * DEFAULT_CONTEXT * 2
    assert fit(GB, 0, 10 * GB).verdict == "fits"
    assert fit(9 * GB - OVERHEAD, 0, 10 * GB).verdict == "tight"
    assert fit(10 * GB, 1, 10 * GB).verdict == "too big"
    assert fit(10, None, 10 * GB).needed == 10 + OVERHEAD


def rows(app, table_id: str) -> list[list[str]]:
    table = app.screen.query_one(table_id, DataTable)
    return [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]


async def test_library_lists_models_with_fit_and_loads_one(tmp_path, model_dir):
    first, second = FakeBackend(["a"]), FakeBackend(["b"], name="small")
    app = make_app(tmp_path, first, second, config=TuiConfig(model_dirs=(model_dir,)))
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+l")
        assert isinstance(app.screen, ModelScreen)
        await wait_for(pilot, lambda: len(rows(app, "#library-table")) == 2)
        table = rows(app, "#library-table")
        by_name = {r[0]: r for r in table}
        assert by_name["small"][3:] == ["llama", "256", "fits"]
        assert by_name["huge"][3:] == ["llama", "131072", "too big"]
        app.screen.query_one("#library-table", DataTable).focus()
        app.screen.query_one("#library-table", DataTable).move_cursor(
            row=[r[0] for r in table].index("small")
        )
        await pilot.press("enter")  # the load dialog, Load focused: Enter again loads
        await wait_for(pilot, lambda: isinstance(app.screen, LoadModal))
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.backend is second)
        assert app.loader.asked[-1] == str(model_dir / "small.gguf")
        assert app.loader.residencies[-1] is None  # no flags typed: the TUI's own
        assert first.closed  # the previous model was unloaded first
        assert not isinstance(app.screen, ModelScreen)
        await pilot.press("ctrl+l", "ctrl+u")
        await wait_for(pilot, lambda: app.backend is None and second.closed)
        assert app.model_state == "no model"


class FakeHub:
    def __init__(self, tmp_path: Path):
        self.pulls: list[tuple] = []
        self.file = tmp_path / "pulled-Q4_K_M.gguf"
        self.file.write_bytes(b"GGUF")

    def search(self, query, config, limit=30):
        assert limit == 30
        return [
            hub_search.HubRepo(f"org/{query}-GGUF", 1234, 5, None),
            hub_search.HubRepo("other/thing-GGUF", 10, 0, None),
        ]

    def quants(self, repo, config):
        return [
            hub_search.QuantChoice("Q4_K_M", 2_500_000_000, ("m-Q4_K_M.gguf",), None),
            hub_search.QuantChoice("Q8_0", 4_100_000_000, ("m-Q8_0.gguf",), "mmproj-f16.gguf"),
        ]

    def pull(self, repo, quant=None, *, filename=None, revision=None, config=None, progress=None):
        self.pulls.append((repo, quant, config))
        for done in (0, 500, 1000):
            progress(Progress("m.gguf", done, 1000, 100.0, (1000 - done) / 100))
        return hub_download.PulledModel(
            f"{repo}:{quant}", repo, quant, "abc", (self.file,), None, 1000
        )


@pytest.fixture
def fake_hub(tmp_path, monkeypatch) -> FakeHub:
    hub = FakeHub(tmp_path)
    monkeypatch.setattr(hub_search, "search_models", hub.search)
    monkeypatch.setattr(hub_search, "repo_quants", hub.quants)
    monkeypatch.setattr(hub_download, "pull", hub.pull)
    return hub


async def test_hub_search_quants_and_download_progress(tmp_path, fake_hub):
    app = make_app(tmp_path, FakeBackend(["a"]))
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+l", "ctrl+f")
        app.screen.query_one("#hub-search", Input).value = "qwen"
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(rows(app, "#repos")) == 2)
        assert rows(app, "#repos")[0] == ["org/qwen-GGUF", "1,234", "5"]
        await pilot.press("enter")  # the repos table has focus
        await wait_for(pilot, lambda: len(rows(app, "#quants")) == 2)
        assert rows(app, "#quants") == [["Q4_K_M", "2.5 GB", ""], ["Q8_0", "4.1 GB", "yes"]]
        await pilot.press("down", "enter")
        await wait_for(pilot, lambda: app.screen.query(DownloadRow).first().has_class("done"))
        (repo, quant, config) = fake_hub.pulls[0]
        assert (repo, quant, config) == ("org/qwen-GGUF", "Q8_0", app.hub_config())
        row = app.screen.query_one(DownloadRow)
        assert row.title == "org/qwen-GGUF:Q8_0"
        assert "done: 1.0 KB fetched" in str(row.query_one(".detail").render())


async def test_pasting_a_hub_spec_downloads_and_loads_it(tmp_path, fake_hub):
    second = FakeBackend(["b"], name="pulled")
    app = make_app(tmp_path, FakeBackend(["a"]), second)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        app.screen.query_one(PromptInput).post_message(events.Paste("org/cool-GGUF:Q4_K_M"))
        await wait_for(pilot, lambda: app.backend is second)
        assert fake_hub.pulls[0][:2] == ("org/cool-GGUF", "Q4_K_M")
        assert app.loader.asked[-1] == str(fake_hub.file)
        assert app.chat.query_one(PromptInput).value == ""  # not typed into the message


async def test_pasting_a_gguf_path_loads_it_and_plain_text_is_typed(tmp_path, model_dir):
    second = FakeBackend(["b"])
    app = make_app(tmp_path, FakeBackend(["a"]), second)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        prompt = app.screen.query_one(PromptInput)
        prompt.post_message(events.Paste("and/or"))
        await wait_for(pilot, lambda: prompt.value == "and/or")
        prompt.value = ""
        prompt.post_message(events.Paste(f"'{model_dir / 'small.gguf'}'"))
        await wait_for(pilot, lambda: app.backend is second)
        assert app.loader.asked[-1] == str(model_dir / "small.gguf")


async def test_dash_m_hub_spec_is_downloaded_then_loaded(tmp_path, fake_hub):
    backend = FakeBackend(["a"], name="pulled")
    app = make_app(tmp_path, backend, model="org/start-GGUF:Q8_0")
    app.loader.local = True  # like the engine loader: the app resolves Hub specs itself
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.backend is backend)
        assert fake_hub.pulls[0][:2] == ("org/start-GGUF", "Q8_0")
        assert app.loader.asked == [str(fake_hub.file)]


async def test_a_failed_load_is_reported_and_leaves_no_model(tmp_path):
    async def broken(name):
        raise ValueError(f"{name}: not a GGUF file")

    app = make_app(tmp_path, model="bad.gguf")
    app.loader = broken
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: bool(app._notifications))
        (note,) = list(app._notifications)
        assert note.message == "bad.gguf: not a GGUF file" and note.severity == "error"
        assert app.backend is None and app.model_state == "no model"


async def test_load_dialog_reads_flags_shows_the_plan_and_loads_under_them(tmp_path):
    """The load dialog takes residency flags in `run`'s spelling: bad ones are refused with the
    parser's message (nothing loads), Plan shows the plan from the header (or why there is
    none), Load hands the loader that residency; the flags are offered again next time."""
    models = tmp_path / "models"
    models.mkdir()
    write_moe_gguf(models / "tiny-moe.gguf")
    tiny_gguf(models / "broken.gguf", 2, 4, 2, 64, 256)  # no feed-forward length: no plan
    first, second = FakeBackend(["a"]), FakeBackend(["b"], name="tiny-moe")
    app = make_app(tmp_path, first, second, config=TuiConfig(model_dirs=(models,)))

    async def open_dialog(pilot, name: str) -> LoadModal:
        await wait_for(pilot, lambda: len(rows(app, "#library-table")) == 2)
        table = app.screen.query_one("#library-table", DataTable)
        table.focus()
        table.move_cursor(row=[r[0] for r in rows(app, "#library-table")].index(name))
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, LoadModal))
        return app.screen

    async with app.run_test(size=(110, 40)) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+l")
        modal = await open_dialog(pilot, "broken")
        await pilot.click("#show-plan")
        text = modal.query_one("#plan-text")
        await wait_for(pilot, lambda: "no plan:" in str(text.render()))
        assert "feed_forward_length" in str(text.render())
        await pilot.press("escape")
        await wait_for(pilot, lambda: isinstance(app.screen, ModelScreen))
        modal = await open_dialog(pilot, "tiny-moe")
        flags, error = modal.query_one("#flags", Input), modal.query_one("#error")
        flags.value = "--expert-slots many"
        await pilot.click("#load")
        assert "many" in str(error.render()) and isinstance(app.screen, LoadModal)
        flags.value = "--cpu-moe --expert-slots 4 --mem-budget 3GiB"
        await pilot.click("#show-plan")
        text = modal.query_one("#plan-text")
        await wait_for(pilot, lambda: "residency plan on" in str(text.render()))
        plan = str(text.render())
        assert "budget   3.00 GiB (given)" in plan and "host-tier experts" in plan
        assert str(error.render()) == ""
        await pilot.click("#load")
        await wait_for(pilot, lambda: app.backend is second)
        cfg = app.loader.residencies[-1]
        assert cfg.budget == 3 << 30 and cfg.streaming.slots == 4
        assert any("exps" in r.pattern and r.tier == "host" for r in cfg.rules)
        assert app.loader.asked[-1] == str(models / "tiny-moe.gguf")
        await pilot.press("ctrl+l")  # again: the flags typed last time are offered
        modal = await open_dialog(pilot, "tiny-moe")
        assert modal.query_one("#flags", Input).value.startswith("--cpu-moe")
        await pilot.press("escape")  # cancel: nothing loads, the model stays
        await wait_for(pilot, lambda: isinstance(app.screen, ModelScreen))
        assert app.backend is second and len(app.loader.asked) == 2
