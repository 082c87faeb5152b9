"""One chat message: a role line and its Markdown body (streamed into while it is generated)."""

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Label, Markdown

ROLE_TITLES = {"user": "You", "assistant": "Assistant", "system": "System"}


class MessageView(Vertical):
    DEFAULT_CSS = """
    MessageView { height: auto; margin: 0 0 1 0; padding: 0 1; }
    MessageView > .role { text-style: bold; color: $text-muted; }
    MessageView.user > .role { color: $accent; }
    MessageView.assistant > .role { color: $success; }
    MessageView > Markdown { margin: 0; padding: 0; }
    MessageView > Markdown > MarkdownBlock:last-child { margin-bottom: 0; }
    """

    def __init__(self, role: str, content: str = "", message_id: int | None = None) -> None:
        super().__init__(classes=role)
        self.role = role
        self.content = content
        self.message_id = message_id

    def compose(self) -> ComposeResult:
        yield Label(ROLE_TITLES.get(self.role, self.role), classes="role")
        yield Markdown(self.content)

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    def set_note(self, note: str) -> None:
        """A suffix on the role line (e.g. "stopped")."""
        title = ROLE_TITLES.get(self.role, self.role)
        self.query_one(".role", Label).update(f"{title} ({note})" if note else title)
