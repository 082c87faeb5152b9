"""The load dialog: which model, its residency flags in the command line's spelling, the plan
they give (from the file's header, nothing loaded), then Load or Cancel.

Enter on a library row opens it with Load focused, so Enter twice loads with the flags the TUI
started with; typed flags (`--cpu-moe --expert-slots 64`, `--ot 'blk\\.1\\..*_exps=disk'`)
replace those for this load, over the environment and a `--residency` document as on `run`;
`--lora PATH[:SCALE]` (repeatable) loads LoRA adapters with the model.
"""

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Button, Input, Label, Static

from localllm.app.residency_flags import plan_text, residency_from_text
from localllm.app.tui.screens.modals import Dialog
from localllm.offload.residency import ResidencyConfig, ResidencyError


@dataclass(frozen=True)
class LoadChoice:
    """What the dialog answers: the flags as typed and the residency they mean (None: no flags
    typed, the TUI's own)."""

    flags: str
    residency: ResidencyConfig | None
    lora: tuple[str, ...] = ()  # `--lora PATH[:SCALE]` values, as on `run`


class LoadModal(Dialog[LoadChoice | None]):
    DEFAULT_CSS = """
    LoadModal > Vertical { width: 100; }
    LoadModal #plan { height: auto; max-height: 18; border: round $foreground 30%; }
    LoadModal #plan-text { width: 100%; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, path: Path, flags: str = "", device: str = "cpu") -> None:
        super().__init__()
        self.path, self.flags, self.device = Path(path), flags, device

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(f"Load {self.path.name}", classes="title")
            yield Label("Residency and --lora flags (as on `localllm run`; empty: the TUI's own)")
            yield Input(self.flags, placeholder="--cpu-moe --expert-slots 64", id="flags")
            yield Label("", classes="error", id="error")
            with VerticalScroll(id="plan"):
                yield Static("", id="plan-text")
            with Horizontal():
                yield Button("Cancel", id="cancel")
                yield Button("Plan", id="show-plan")
                yield Button("Load", variant="primary", id="load")

    def on_mount(self) -> None:
        self.query_one("#load", Button).focus()

    def choice(self) -> LoadChoice:
        """The typed flags read into a residency config; ResidencyError when they are bad."""
        text = self.query_one("#flags", Input).value.strip()
        rest, lora = _split_lora(text)
        return LoadChoice(text, residency_from_text(rest) if rest else None, lora)

    @on(Button.Pressed, "#load")
    @on(Input.Submitted, "#flags")
    def load(self) -> None:
        try:
            self.dismiss(self.choice())
        except ResidencyError as e:
            self.query_one("#error", Label).update(str(e))

    @on(Button.Pressed, "#show-plan")
    def show_plan(self) -> None:
        try:
            config = self.choice().residency or ResidencyConfig()
        except ResidencyError as e:
            self.query_one("#error", Label).update(str(e))
            return
        self.query_one("#error", Label).update("")
        self.query_one("#plan-text", Static).update("reading the header…")
        self._plan(config)

    @work(thread=True, exclusive=True, group="plan")
    def _plan(self, config: ResidencyConfig) -> None:
        try:
            text = plan_text(self.path, config, self.device)
        except Exception as e:  # a bad file or a plan that cannot fit: say why, load nothing
            text = f"no plan: {e}"
        self.app.call_from_thread(self.query_one("#plan-text", Static).update, text)

    @on(Button.Pressed, "#cancel")
    def cancel(self) -> None:
        self.dismiss(None)


def _split_lora(text: str) -> tuple[str, tuple[str, ...]]:
    """(the other flags, the `--lora` values) of the typed text."""
    try:
        words, rest, lora = shlex.split(text), [], []
    except ValueError as e:  # an unclosed quote
        raise ResidencyError(f"cannot read the flags: {e}") from None
    while words:
        w = words.pop(0)
        if w == "--lora" or w.startswith("--lora="):
            value = w.partition("=")[2] or (words.pop(0) if words else "")
            if not value:
                raise ResidencyError("--lora needs PATH[:SCALE]")
            lora.append(value)
        else:
            rest.append(w)
    return shlex.join(rest), tuple(lora)
