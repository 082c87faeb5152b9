"""The TUI app shell: holds the chat backend, the history store and the config; owns model loading
(in a worker, so the screen stays live while a model loads) and pasted/dropped model references."""

from collections.abc import Iterable
from pathlib import Path
from typing import ClassVar

from textual import events, work
from textual.app import App, SystemCommand
from textual.binding import Binding, BindingType
from textual.reactive import reactive
from textual.screen import Screen

from localllm.app.hub.spec import ModelSpec
from localllm.app.tui.backend import ChatBackend
from localllm.app.tui.config import TuiConfig
from localllm.app.tui.drop import drop_spec
from localllm.app.tui.history import HistoryStore
from localllm.app.tui.loaders import Loader
from localllm.app.tui.screens.chat import ChatScreen
from localllm.app.tui.widgets.prompt import ModelDropped


class LocalLLMApp(App):
    CSS_PATH = "app.tcss"
    TITLE = "localllm"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("ctrl+l", "models", "Models"),
        Binding("ctrl+t", "toggle_theme", "Theme", show=False),
        Binding("ctrl+q", "quit", "Quit"),
    ]
    model_state: reactive[str] = reactive("no model")

    def __init__(
        self,
        store: HistoryStore,
        loader: Loader | None = None,
        *,
        model: str | None = None,
        load_on_start: bool = True,
        config: TuiConfig | None = None,
        export_dir: Path | None = None,
    ) -> None:
        super().__init__()
        self.store = store
        self.loader = loader
        self.config = config or TuiConfig()
        self.export_dir = export_dir or Path.cwd()
        self.backend: ChatBackend | None = None
        self._initial = (model, load_on_start)

    def on_mount(self) -> None:
        self.theme = self.config.theme
        self.push_screen(ChatScreen())
        model, load = self._initial
        if load and self.loader is not None:
            self.load_model(model or self.config.default_model)

    @property
    def chat(self) -> ChatScreen:
        return next(s for s in self.screen_stack if isinstance(s, ChatScreen))

    # -- models ------------------------------------------------------------------------------

    def load_model(self, name: str | None) -> None:
        """Load `name` (a path or library name; None: the default) in place of the current one."""
        if name and drop_spec(name) is not None and drop_spec(name).kind == "hub":
            self.download(drop_spec(name), load=True)
            return
        self._load(name)

    @work(exclusive=True, group="load")
    async def _load(self, name: str | None) -> None:
        await self.unload_model()
        self.model_state = f"loading {Path(name).name if name else 'the default model'}…"
        try:
            backend = await self.loader(name)
        except Exception as e:
            self.model_state = "no model"
            self.notify(str(e) or type(e).__name__, title="Cannot load model", severity="error")
            return
        self.backend = backend
        self.model_state = "ready"

    async def unload_model(self) -> None:
        chat = self.chat
        if chat.generating:
            chat.answer_worker.cancel()
            await chat.answer_worker.wait()
        backend, self.backend = self.backend, None
        self.model_state = "no model"
        if backend is not None:
            await backend.close()

    def download(self, spec: ModelSpec, load: bool = False) -> None:
        """Pull a Hub model with a progress bar on the Models screen (then load it, if asked)."""
        if "models" not in self._installed_screens:
            self.notify(f"Cannot download {spec.text}: no Models screen", severity="error")
            return
        self.action_models()
        self.get_screen("models").download(spec, load=load)

    def handle_drop(self, spec: ModelSpec) -> None:
        if spec.kind == "path":
            self.notify(f"Loading {spec.path}")
            self.load_model(str(spec.path))
        else:
            self.download(spec, load=True)

    def on_model_dropped(self, event: ModelDropped) -> None:
        self.handle_drop(event.spec)

    def on_paste(self, event: events.Paste) -> None:
        spec = drop_spec(event.text)
        if spec is not None:
            self.handle_drop(spec)

    # -- actions -----------------------------------------------------------------------------

    def action_models(self) -> None:
        if "models" in self._installed_screens and self.screen.id != "models":
            self.push_screen("models")

    def action_toggle_theme(self) -> None:
        self.theme = "textual-light" if self.current_theme.dark else "textual-dark"

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        chat = self.chat
        yield SystemCommand("New chat", "Start a new conversation", chat.action_new_chat)
        yield SystemCommand("Models", "Library, Hub search and downloads", self.action_models)
        yield SystemCommand("Toggle light/dark", "Switch the theme", self.action_toggle_theme)
        yield SystemCommand("Chat settings", "System prompt, sampling", chat.action_sampling)
        yield SystemCommand("Regenerate", "Answer the last message again", chat.action_regenerate)
        yield SystemCommand("Edit last message", "Edit and resend", chat.action_edit_last)
        yield SystemCommand("Rename conversation", "Give it a title", chat.action_rename)
        yield SystemCommand("Export conversation", "Write it as Markdown", chat.action_export)
        yield SystemCommand("Delete conversation", "Remove it from history", chat.action_delete)
        yield SystemCommand("Unload model", "Free the model's memory", self.unload_model)

    async def action_quit(self) -> None:
        chat = self.chat
        if chat.generating:  # keep the partial answer
            chat.answer_worker.cancel()
            await chat.answer_worker.wait()
        if self.backend is not None:
            await self.backend.close()
        self.exit()
