"""One chat message: a role line, a reasoning model's think block (shown only when there is
reasoning) and its Markdown body; both are streamed into while the answer is generated. A user
message's attached images show as chips and small previews (`image_preview`)."""

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Label, Markdown

from localllm.app.tui.images import chips, split_images
from localllm.app.tui.widgets.image_preview import ImagePreview

ROLE_TITLES = {"user": "You", "assistant": "Assistant", "system": "System"}


class MessageView(Vertical):
    DEFAULT_CSS = """
    MessageView { height: auto; margin: 0 0 1 0; padding: 0 1; }
    MessageView > .role { text-style: bold; color: $text-muted; }
    MessageView.user > .role { color: $accent; }
    MessageView.assistant > .role { color: $success; }
    MessageView > Markdown { margin: 0; padding: 0; }
    MessageView > .previews { height: auto; width: auto; }
    MessageView > Markdown > MarkdownBlock:last-child { margin-bottom: 0; }
    MessageView > Markdown.think {
        color: $text-muted; text-style: italic;
        border-left: outer $foreground 30%; padding-left: 1; margin-bottom: 1;
    }
    """

    def __init__(
        self,
        role: str,
        content: str = "",
        message_id: int | None = None,
        reasoning: str | None = None,
    ) -> None:
        super().__init__(classes=role)
        self.role = role
        self.content = content
        self.reasoning = reasoning or ""
        self.message_id = message_id

    def compose(self) -> ComposeResult:
        yield Label(ROLE_TITLES.get(self.role, self.role), classes="role")
        think = Markdown(self.reasoning, classes="think")
        think.display = bool(self.reasoning)
        yield think
        paths = split_images(self.content)[0] if self.role == "user" else []
        if paths:
            with Horizontal(classes="previews"):
                for p in paths:
                    yield ImagePreview(p)
        yield Markdown(chips(self.content), classes="answer")  # attached images as chips

    @property
    def markdown(self) -> Markdown:
        return self.query_one("Markdown.answer", Markdown)

    @property
    def think(self) -> Markdown:
        """The reasoning block (hidden until reasoning arrives)."""
        return self.query_one("Markdown.think", Markdown)

    def set_note(self, note: str) -> None:
        """A suffix on the role line (e.g. "stopped")."""
        title = ROLE_TITLES.get(self.role, self.role)
        self.query_one(".role", Label).update(f"{title} ({note})" if note else title)
