"""One download in progress: its name, a progress bar, and bytes/speed/ETA (or the outcome)."""

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Label, ProgressBar

from localllm.app.hub.progress import Progress, render


class DownloadRow(Horizontal):
    DEFAULT_CSS = """
    DownloadRow { height: 1; }
    DownloadRow > .name { width: auto; max-width: 30; margin-right: 1; text-style: bold; }
    DownloadRow > ProgressBar { width: 24; }
    DownloadRow > .detail { width: 1fr; color: $text-muted; text-wrap: nowrap; }
    DownloadRow.failed > .detail { color: $error; }
    DownloadRow.done > .detail { color: $success; }
    """

    def __init__(self, name: str) -> None:
        super().__init__()
        self.title = name

    def compose(self) -> ComposeResult:
        yield Label(self.title, classes="name", markup=False)
        yield ProgressBar(show_eta=False, show_percentage=True)
        yield Label("starting…", classes="detail", markup=False)

    def show(self, p: Progress) -> None:
        self.query_one(ProgressBar).update(total=p.total, progress=p.done)
        self.query_one(".detail", Label).update(render(p))

    def finish(self, message: str, ok: bool) -> None:
        if ok:
            bar = self.query_one(ProgressBar)
            bar.update(total=bar.total or 1, progress=bar.total or 1)
        self.add_class("done" if ok else "failed")
        self.query_one(".detail", Label).update(message)
