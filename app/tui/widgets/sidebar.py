"""The conversation list: a search box over titles and message text, newest conversations first."""

from textual import on
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Input, Label, ListItem, ListView

from localllm.app.tui.history import Conversation


class ConversationItem(ListItem):
    def __init__(self, conversation: Conversation) -> None:
        super().__init__(Label(conversation.title, markup=False))
        self.conversation = conversation


class ConversationList(Vertical):
    DEFAULT_CSS = """
    ConversationList { height: 1fr; }
    ConversationList > Input { margin: 0; }
    ConversationList > ListView { height: 1fr; }
    ConversationList > ListView > ListItem > Label {
        width: 1fr; text-wrap: nowrap; text-overflow: ellipsis;  /* auto width: clipped, no … */
    }
    """

    class Selected(Message):
        def __init__(self, conversation: Conversation) -> None:
            super().__init__()
            self.conversation = conversation

    class SearchChanged(Message):
        def __init__(self, query: str) -> None:
            super().__init__()
            self.query = query

    def compose(self) -> ComposeResult:
        yield Input(placeholder="search chats", id="search")
        yield ListView(id="conversations")

    @property
    def query_text(self) -> str:
        return self.query_one("#search", Input).value

    async def show(self, conversations: list[Conversation], current: int | None) -> None:
        view = self.query_one(ListView)
        await view.clear()
        await view.extend(ConversationItem(c) for c in conversations)
        for i, c in enumerate(conversations):
            if c.id == current:
                view.index = i

    @on(Input.Changed, "#search")
    def _search(self, event: Input.Changed) -> None:
        event.stop()
        self.post_message(self.SearchChanged(event.value))

    @on(Input.Submitted, "#search")
    def _submit_search(self, event: Input.Submitted) -> None:
        event.stop()  # not a chat message
        self.query_one(ListView).focus()

    @on(ListView.Selected)
    def _selected(self, event: ListView.Selected) -> None:
        event.stop()
        if isinstance(event.item, ConversationItem):
            self.post_message(self.Selected(event.item.conversation))
