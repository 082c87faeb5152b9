"""A scripted chat backend for fast TUI tests, and small Pilot helpers."""

import asyncio
from collections.abc import Callable
from pathlib import Path

from localllm.app.hub.download import HubConfig
from localllm.app.tui.app import LocalLLMApp
from localllm.app.tui.backend import ChatDelta, GenSettings
from localllm.app.tui.history import HistoryStore
from localllm.app.tui.resources import Memory

GB = 1_000_000_000
# Fixed memory figures so fit verdicts and the resource panel are deterministic.
MEMORY = Memory(ram_total=16 * GB, ram_available=10 * GB, process_rss=GB // 2)


class FakeBackend:
    """Streams scripted answers in `chunk`-character pieces. With `hold`, it pauses after the
    first piece until `release` is set (to stop mid-stream)."""

    model_bytes = 123_456

    def __init__(
        self, answers: list[str], chunk: int = 3, hold: bool = False, name: str = "fake-model"
    ):
        self.answers = list(answers)
        self.chunk = chunk
        self.hold = hold
        self.name = name
        self.calls: list[tuple[list[dict], GenSettings]] = []
        self.release = asyncio.Event()
        self.closed = False

    @property
    def max_model_len(self) -> int:
        return 2048

    async def stream(self, messages, settings):
        self.calls.append(([dict(m) for m in messages], settings))
        answer = self.answers[min(len(self.calls), len(self.answers)) - 1]
        pieces = [answer[i : i + self.chunk] for i in range(0, len(answer), self.chunk)]
        prompt_tokens = sum(len(m["content"]) for m in messages)
        for i, piece in enumerate(pieces):
            if i == 1 and self.hold:
                await self.release.wait()
            await asyncio.sleep(0)
            last = i == len(pieces) - 1
            yield ChatDelta(piece, prompt_tokens, i + 1, "stop" if last else None)

    async def close(self) -> None:
        self.closed = True


def loader_for(*backends: FakeBackend):
    """A loader handing out the given backends in turn (records the names asked for)."""
    queue = list(backends)
    asked: list[str | None] = []
    residencies: list = []  # the residency of each load (None: the loader's own)

    async def load(name, residency=None):
        asked.append(name)
        residencies.append(residency)
        return queue.pop(0)

    load.asked, load.residencies = asked, residencies
    load.local, load.device = True, "cpu"  # like the engine's loader (load dialog, Hub specs)
    return load


async def wait_for(pilot, cond: Callable[[], bool], limit: int = 400) -> None:
    """Let the app run until `cond()` holds (fails the test after `limit` pauses)."""
    for _ in range(limit):
        if cond():
            return
        await pilot.pause(0.01)
    raise AssertionError("condition never became true")


def offline_hub(tmp_path: Path) -> Callable[[], HubConfig]:
    """An empty HF cache under tmp_path and a Hub nobody listens on."""
    config = HubConfig("http://127.0.0.1:9", tmp_path / "hf-cache", offline=True)
    return lambda: config


def make_app(tmp_path: Path, *backends: FakeBackend, **kw) -> LocalLLMApp:
    """The app over a fresh history file, fake backends, fixed memory and an empty HF cache."""
    kw.setdefault("probe", lambda: MEMORY)
    kw.setdefault("hub_config", offline_hub(tmp_path))
    kw.setdefault("export_dir", tmp_path)
    store = kw.pop("store", None) or HistoryStore(tmp_path / "h.sqlite3")
    return LocalLLMApp(store, loader_for(*backends), **kw)
