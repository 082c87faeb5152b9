"""The TUI app shell: holds the chat backend, the history store, the config and the speech models;
owns model loading (in a worker, so the screen stays live while a model loads) and pasted/dropped
model references and audio files."""

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import ClassVar

from textual import events, work
from textual.app import App, SystemCommand
from textual.binding import Binding, BindingType
from textual.reactive import reactive
from textual.screen import Screen

from localllm.app.hub.download import HubConfig, cached_model
from localllm.app.hub.spec import ModelSpec, parse_spec
from localllm.app.tui.backend import ChatBackend
from localllm.app.tui.commands import main_commands
from localllm.app.tui.config import TuiConfig
from localllm.app.tui.drop import drop_audio, drop_spec
from localllm.app.tui.history import HistoryStore
from localllm.app.tui.images import image_path
from localllm.app.tui.loaders import Loader
from localllm.app.tui.resources import Memory, probe_memory
from localllm.app.tui.screens.chat import ChatScreen
from localllm.app.tui.screens.models import ModelScreen
from localllm.app.tui.speech import Player, SpeechModels, sounddevice_player
from localllm.app.tui.widgets.prompt import ModelDropped
from localllm.offload.residency import ResidencyConfig


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
        config: TuiConfig | None = None,
        export_dir: Path | None = None,
        probe: Callable[[], Memory] = probe_memory,
        hub_config: Callable[[], HubConfig] = HubConfig.current,
        player: Player = sounddevice_player,
    ) -> None:
        super().__init__()
        self.store, self.loader, self.initial_model = store, loader, model
        self.config = config or TuiConfig()
        self.export_dir = export_dir or Path.cwd()
        self.probe, self.hub_config = probe, hub_config
        self.backend: ChatBackend | None = None
        self.load_flags: dict[str, str] = {}  # residency flags last typed per model (load dialog)
        self.speech = SpeechModels(self.config.whisper_model, self.config.voice)
        self.player = player

    def on_mount(self) -> None:
        self.theme = self.config.theme
        self.install_screen(ModelScreen(), "models")
        self.push_screen(ChatScreen())
        if self.loader is not None:
            self.load_model(self.initial_model or self.config.default_model)

    @property
    def chat(self) -> ChatScreen:
        return next(s for s in self.screen_stack if isinstance(s, ChatScreen))

    @property
    def last_speed(self) -> float | None:
        stats = self.chat.stats
        return stats.tokens_per_s if stats else None

    # -- models ------------------------------------------------------------------------------

    def load_model(
        self, name: str | None, residency: ResidencyConfig | None = None, lora: tuple = ()
    ) -> None:
        """Load `name` (path, library name, `org/repo:QUANT`; None: the default) in place of the
        current model, under `residency` (None: the loader's own; the local engine only); a Hub
        model not yet downloaded is downloaded first."""
        if name and getattr(self.loader, "local", False):  # an endpoint's model ids are no specs
            try:
                spec = parse_spec(name)
            except ValueError as e:
                self.notify(str(e), title="Cannot load model", severity="error")
                return
            if spec.kind == "hub":
                rev = spec.revision or "main"
                found = cached_model(self.hub_config(), spec.repo, spec.quant, spec.filename, rev)
                if found is None:
                    self.download(spec, load=True)
                    return
                name = str(found.path)
        self._load(name, residency, lora)

    @work(exclusive=True, group="load")
    async def _load(
        self, name: str | None, residency: ResidencyConfig | None = None, lora: tuple = ()
    ) -> None:
        await self.unload_model()
        self.model_state = f"loading {Path(name).name if name else 'the default model'}…"
        try:
            kw = {"residency": residency} if residency is not None else {}
            if lora:  # `--lora` typed in the load dialog (the local engine only)
                kw["lora"] = lora
            backend = await self.loader(name, **kw)
        except Exception as e:
            self.model_state = "no model"
            self.notify(str(e) or type(e).__name__, title="Cannot load model", severity="error")
            self.chat.model_ready(False)
            return
        self.backend = backend
        self.model_state = "ready"
        self.chat.model_ready(True)

    @property
    def loading(self) -> bool:
        """Is a model being loaded (a message sent now is answered once it is ready)?"""
        return any(w.group == "load" and not w.is_finished for w in self.workers)

    async def unload_model(self) -> None:
        await self.chat.stop_answer()  # the partial answer is saved
        backend, self.backend = self.backend, None
        self.model_state = "no model"
        if backend is not None:
            await backend.close()

    def download(self, spec: ModelSpec, load: bool = False) -> None:
        """Pull a Hub model with a progress bar on the Models screen (then load it, if asked)."""
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
        spec = drop_spec(event.text)  # pastes that reach the app: no input box took them
        if spec is not None:
            self.handle_drop(spec)
            return
        audio = drop_audio(event.text)
        if audio is not None:
            self.chat.attach(audio)
            return
        image = image_path(event.text)
        if image is not None:
            self.chat.attach_image(image)

    # -- actions -----------------------------------------------------------------------------

    def action_models(self) -> None:
        if not isinstance(self.screen, ModelScreen):
            self.push_screen("models")

    def action_toggle_theme(self) -> None:
        self.theme = "textual-light" if self.current_theme.dark else "textual-dark"

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield from main_commands(self)

    async def action_quit(self) -> None:
        # A load in progress is abandoned (its thread releases what it loads), not waited for.
        self.workers.cancel_group(self, "load")
        await self.unload_model()  # keeps a partial answer, stops the engine thread
        self.exit()
