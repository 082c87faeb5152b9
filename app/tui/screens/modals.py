"""Small modal dialogs: per-conversation generation settings, a one-line text prompt, a yes/no;
and `Dialog`, their base, which holds the dialog frame's CSS."""

from typing import ClassVar, TypeVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label

from localllm.app.tui.backend import GenSettings

ResultT = TypeVar("ResultT")


class Dialog(ModalScreen[ResultT]):
    """A modal dialog framed in the middle of the screen. The rules name `Dialog` so that they
    reach subclasses: a class's DEFAULT_CSS is scoped to that class's name, so rules naming
    `ModalScreen` in a subclass matched nothing (the settings dialog showed no values)."""

    DEFAULT_CSS = """
    Dialog { align: center middle; }
    Dialog > Vertical {
        width: 64; max-width: 100%; height: auto; max-height: 100%;
        border: thick $primary; background: $surface; padding: 0 1;
    }
    Dialog .title { text-style: bold; margin-bottom: 1; }
    Dialog .error { color: $error; height: auto; }
    Dialog Grid { grid-size: 2; grid-columns: 14 1fr; grid-rows: 3; height: auto; }
    Dialog Grid > Label { padding: 1 0 0 0; }
    Dialog Horizontal { height: 3; align-horizontal: right; }
    Dialog Button { margin-left: 1; min-width: 10; }
    """


FIELDS = (
    ("system_prompt", "System prompt", str),
    ("temperature", "Temperature", float),
    ("top_p", "Top p", float),
    ("max_tokens", "Max tokens", int),
)


class SamplingModal(Dialog[GenSettings | None]):
    """Edit the system prompt, temperature, top_p and max tokens of one conversation."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, settings: GenSettings) -> None:
        super().__init__()
        self.settings = settings

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("Conversation settings", classes="title")
            with Grid():
                for key, title, _ in FIELDS:
                    yield Label(title)
                    yield Input(str(getattr(self.settings, key)), id=key)
            yield Label("", classes="error", id="error")
            with Horizontal():
                yield Button("Cancel", id="cancel")
                yield Button("Save", variant="primary", id="save")

    def values(self) -> GenSettings:
        """The settings as typed; ValueError with a readable message when one is invalid."""
        data = {}
        for key, title, kind in FIELDS:
            raw = self.query_one(f"#{key}", Input).value.strip()
            try:
                data[key] = kind(raw)
            except ValueError:
                raise ValueError(f"{title}: {raw!r} is not a valid {kind.__name__}") from None
        return GenSettings.from_dict(data, base=self.settings)

    @on(Button.Pressed, "#save")
    @on(Input.Submitted)
    def save(self) -> None:
        try:
            self.dismiss(self.values())
        except ValueError as e:
            self.query_one("#error", Label).update(str(e))

    @on(Button.Pressed, "#cancel")
    def cancel(self) -> None:
        self.dismiss(None)


class TextPromptModal(Dialog[str | None]):
    """Ask for one line of text (rename a conversation)."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, title: str, value: str = "") -> None:
        super().__init__()
        self.title_text, self.value = title, value

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self.title_text, classes="title")
            yield Input(self.value, id="text")

    @on(Input.Submitted)
    def done(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)


class ConfirmModal(Dialog[bool]):
    """A yes/no question; Enter or y confirms."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,n", "dismiss(False)", "No"),
        Binding("y", "dismiss(True)", "Yes"),
    ]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self.question, classes="title")
            with Horizontal():
                yield Button("No", id="no")
                yield Button("Yes", variant="error", id="yes")

    @on(Button.Pressed)
    def answer(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")
