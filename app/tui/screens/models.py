"""The model screen: the local library (sizes, fit verdicts, load/unload/remove) and Hub search
(GGUF repos, their quants and sizes) with download progress bars.

Every Hub and disk operation runs in a thread worker; progress crosses back with
`call_from_thread`, throttled so a fast download does not flood the screen.
"""

import time
from typing import ClassVar

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Input, TabbedContent, TabPane

from localllm.app.hub import download as hub_download
from localllm.app.hub import library as hub_library
from localllm.app.hub import search as hub_search
from localllm.app.hub.progress import Progress, human_bytes
from localllm.app.hub.spec import ModelSpec
from localllm.app.tui.fit import LibraryEntry, scan_entries
from localllm.app.tui.resources import available_for_model
from localllm.app.tui.screens.load_modal import LoadChoice, LoadModal
from localllm.app.tui.screens.modals import ConfirmModal
from localllm.app.tui.widgets.download import DownloadRow
from localllm.app.tui.widgets.resources import ResourcePanel

PROGRESS_INTERVAL = 0.1  # seconds between progress redraws per download


class ModelScreen(Screen):
    CSS_PATH = "models.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "app.pop_screen", "Chat"),
        Binding("ctrl+u", "unload", "Unload"),
        Binding("ctrl+r", "rescan", "Rescan"),
        Binding("delete", "remove", "Remove", show=False),
        Binding("ctrl+f", "search", "Hub search"),
    ]

    def __init__(self) -> None:
        super().__init__(id="models")
        self.entries: list[LibraryEntry] = []
        self.repo: str | None = None
        self.quants: list = []
        # Downloads asked for before the screen was mounted; None once it is.
        self.pending: list[tuple[ModelSpec, bool]] | None = []

    def compose(self) -> ComposeResult:
        with TabbedContent(initial="library"):
            with TabPane("Library", id="library"):
                yield DataTable(id="library-table", cursor_type="row", zebra_stripes=True)
            with TabPane("Hub", id="hub"):
                yield Input(placeholder="search GGUF models on the Hub (Enter)", id="hub-search")
                with Horizontal(id="hub-tables"):
                    yield DataTable(id="repos", cursor_type="row")
                    yield DataTable(id="quants", cursor_type="row")
        yield Vertical(id="downloads")
        yield ResourcePanel(compact=True)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#library-table", DataTable).add_columns(
            "Name", "Quant", "Size", "Arch", "Ctx", "Fit"
        )
        self.query_one("#repos", DataTable).add_columns("Repository", "Downloads", "Likes")
        self.query_one("#quants", DataTable).add_columns("Quant", "Size", "mmproj")
        self.action_rescan()
        pending, self.pending = self.pending, None
        for spec, load in pending:
            self.download(spec, load)

    # -- library ---------------------------------------------------------------------------

    @work(thread=True, exclusive=True, group="scan")
    def action_rescan(self) -> None:
        available = available_for_model(self.app.probe())
        config = self.app.hub_config()
        dirs = self.app.config.model_dirs + self.app.config.builtin_dirs
        entries = scan_entries(config.cache_dir, dirs, available)
        self.app.call_from_thread(self._show_library, entries)

    def _show_library(self, entries: list[LibraryEntry]) -> None:
        self.entries = entries
        table = self.query_one("#library-table", DataTable)
        table.clear()
        for e in entries:
            m = e.model
            table.add_row(
                m.name,
                m.quant or "-",
                human_bytes(m.size),
                (m.architecture or "?") + ("(vision)" if m.vision else ""),
                str(m.context_length or "?"),
                e.fit.verdict,
            )

    @on(DataTable.RowSelected, "#library-table")
    def _load_selected(self, event: DataTable.RowSelected) -> None:
        """The load dialog (residency flags, the plan) for the local engine; an endpoint's
        models load at once."""
        model = self.entries[event.cursor_row].model
        path = str(model.path)

        def load(choice: LoadChoice | None) -> None:
            if choice is None:
                return
            self.app.load_flags[path] = choice.flags
            self.app.load_model(path, choice.residency, choice.lora)
            self.notify(f"Loading {model.name}")
            self.app.pop_screen()

        loader = self.app.loader
        if not getattr(loader, "local", False):
            load(LoadChoice("", None))
            return
        flags = self.app.load_flags.get(path, "")
        self.app.push_screen(LoadModal(model.path, flags, getattr(loader, "device", "cpu")), load)

    async def action_unload(self) -> None:
        await self.app.unload_model()
        self.notify("Model unloaded")

    def action_remove(self) -> None:
        table = self.query_one("#library-table", DataTable)
        if not self.entries or not table.has_focus:
            return
        model = self.entries[table.cursor_row].model

        def done(yes: bool | None) -> None:
            if yes:
                self._remove(model)

        self.app.push_screen(ConfirmModal(f"Delete {model.name} from disk?"), done)

    @work(thread=True, group="remove")
    def _remove(self, model) -> None:
        try:
            freed = hub_library.remove_model(model, self.app.hub_config().cache_dir)
        except Exception as e:
            self.app.call_from_thread(self.notify, str(e), severity="error")
            return
        self.app.call_from_thread(self.notify, f"Removed {model.name} ({human_bytes(freed)})")
        self.app.call_from_thread(self.action_rescan)

    # -- hub -------------------------------------------------------------------------------

    def action_search(self) -> None:
        self.query_one(TabbedContent).active = "hub"
        self.query_one("#hub-search", Input).focus()

    @on(Input.Submitted, "#hub-search")
    def _search(self, event: Input.Submitted) -> None:
        self.search(event.value)

    @work(thread=True, exclusive=True, group="search")
    def search(self, query: str) -> None:
        try:
            repos = hub_search.search_models(query, self.app.hub_config(), limit=30)
        except Exception as e:
            self.app.call_from_thread(self.notify, str(e), title="Hub search", severity="error")
            return
        self.app.call_from_thread(self._show_repos, repos)

    def _show_repos(self, repos: list) -> None:
        table = self.query_one("#repos", DataTable)
        table.clear()
        for r in repos:
            table.add_row(r.repo_id, f"{r.downloads:,}", str(r.likes), key=r.repo_id)
        self.query_one("#quants", DataTable).clear()
        if repos:
            table.focus()
        else:
            self.notify("No GGUF repositories match")

    @on(DataTable.RowSelected, "#repos")
    def _repo_selected(self, event: DataTable.RowSelected) -> None:
        self.show_quants(event.row_key.value)

    @work(thread=True, exclusive=True, group="quants")
    def show_quants(self, repo: str) -> None:
        try:
            quants = hub_search.repo_quants(repo, self.app.hub_config())
        except Exception as e:
            self.app.call_from_thread(self.notify, str(e), title=repo, severity="error")
            return
        self.app.call_from_thread(self._show_quants, repo, quants)

    def _show_quants(self, repo: str, quants: list) -> None:
        self.repo, self.quants = repo, quants
        table = self.query_one("#quants", DataTable)
        table.clear()
        for q in quants:
            table.add_row(q.quant, human_bytes(q.size), "yes" if q.mmproj else "")
        table.focus()

    @on(DataTable.RowSelected, "#quants")
    def _quant_selected(self, event: DataTable.RowSelected) -> None:
        q = self.quants[event.cursor_row]
        text = f"{self.repo}:{q.quant}"
        self.download(ModelSpec("hub", text, repo=self.repo, quant=q.quant))

    # -- downloads -------------------------------------------------------------------------

    def download(self, spec: ModelSpec, load: bool = False) -> None:
        if self.pending is not None:
            self.pending.append((spec, load))
            return
        row = DownloadRow(spec.text)
        self.query_one("#downloads").mount(row)
        self._pull(spec, row, load)

    @work(thread=True, group="download")
    def _pull(self, spec: ModelSpec, row: DownloadRow, load: bool) -> None:
        last = [0.0]  # closure state: when the bar was last redrawn

        def progress(p: Progress) -> None:
            now = time.monotonic()
            if p.finished or now - last[0] >= PROGRESS_INTERVAL:
                last[0] = now
                self.app.call_from_thread(row.show, p)

        try:
            pulled = hub_download.pull(
                spec.repo,
                spec.quant,
                filename=spec.filename,
                revision=spec.revision,
                config=self.app.hub_config(),
                progress=progress,
            )
        except Exception as e:
            self.app.call_from_thread(row.finish, str(e), False)
            self.app.call_from_thread(self.notify, str(e), title="Download", severity="error")
            return
        got = f"done: {human_bytes(pulled.downloaded)} fetched"
        self.app.call_from_thread(row.finish, got, True)
        self.app.call_from_thread(self.action_rescan)
        if load:
            self.app.call_from_thread(self.app.load_model, str(pulled.path))
