"""The chat screen: conversation list, streamed answers, stop/regenerate/edit, status line.

The user message is committed before generation starts and the answer when it ends (or is
stopped, or the app quits: the partial text is kept; `chat_answer`), so a killed app loses no
finished message. A message sent while the model loads is committed and queued, and answered
once the model is ready.
"""

from typing import ClassVar

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Static

from localllm.app.tui.backend import GenSettings
from localllm.app.tui.history import Conversation, StoredMessage, conversation_title
from localllm.app.tui.screens.chat_actions import ConversationActions
from localllm.app.tui.screens.chat_answer import AnswerStreaming
from localllm.app.tui.screens.chat_images import ImageActions
from localllm.app.tui.screens.chat_music import MusicActions
from localllm.app.tui.screens.chat_speech import SpeechActions
from localllm.app.tui.screens.modals import SamplingModal
from localllm.app.tui.stats import GenStats, status_text
from localllm.app.tui.widgets.message import MessageView
from localllm.app.tui.widgets.prompt import ImageDropped, PromptInput
from localllm.app.tui.widgets.resources import ResourcePanel
from localllm.app.tui.widgets.sidebar import ConversationList

QUEUED = "message queued until the model is ready"
SIDE_MIN_WIDTH = 100  # columns: narrower terminals hide the side panel (ctrl+b shows it)


class ChatScreen(
    AnswerStreaming, ConversationActions, SpeechActions, MusicActions, ImageActions, Screen
):
    CSS_PATH = "chat.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "stop", "Stop", priority=True),
        Binding("ctrl+c", "stop", "Stop", show=False, priority=True),
        Binding("ctrl+r", "regenerate", "Regen", priority=True),
        Binding("ctrl+e", "edit_last", "Edit", priority=True),
        Binding("ctrl+n", "new_chat", "New"),
        Binding("ctrl+s", "sampling", "Params", priority=True),
        Binding("ctrl+b", "toggle_sidebar", "Chats"),
        Binding("f2", "rename", "Rename", show=False),
        Binding("f3", "export", "Export", show=False),
        Binding("f8", "delete", "Delete", show=False),
        Binding("ctrl+y", "copy_answer", "Copy", show=False),
        Binding("ctrl+o", "attach", "Audio", show=False, priority=True),
        Binding("f4", "speak", "Speak", show=False),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.conversation: Conversation | None = None
        self.history: list[StoredMessage] = []
        self.editing: StoredMessage | None = None
        self.stats: GenStats | None = None
        self.queued = False  # the last user message waits for the model being loaded
        self.wide: bool | None = None  # was the terminal SIDE_MIN_WIDTH wide at the last look?
        self.pending_images: list = []  # attached to the next message (`chat_images`)

    def compose(self) -> ComposeResult:
        with Horizontal():
            with Vertical(id="side"):
                yield ConversationList(id="sidebar")
                yield ResourcePanel(id="resources")
            with Vertical(id="main"):
                yield VerticalScroll(id="messages")
                yield PromptInput(placeholder="Message (Enter to send)", id="prompt")
                yield Static("", id="status")
        yield Footer()

    @property
    def store(self):
        return self.app.store

    def on_mount(self) -> None:
        self.gen_settings: GenSettings = self.app.config.sampling
        self.watch(self.app, "model_state", lambda _: self.refresh_status())
        self._follow_width()
        self.query_one(PromptInput).focus()
        self.refresh_list()

    def on_resize(self) -> None:
        self._follow_width()

    def on_screen_resume(self) -> None:
        self._follow_width()  # the terminal may have changed size behind another screen

    def _follow_width(self) -> None:
        """Show the side panel when the terminal grows to SIDE_MIN_WIDTH columns, hide it when
        it shrinks below; in between, ctrl+b's choice stands."""
        wide = self.app.size.width >= SIDE_MIN_WIDTH
        if wide != self.wide:
            self.wide = wide
            self.query_one("#side").display = wide

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "stop":
            return self.generating or self.editing is not None
        if action in ("regenerate", "edit_last"):
            return not self.generating and bool(self.history)
        return True

    # -- status and list -----------------------------------------------------------------

    def refresh_status(self) -> None:
        backend = self.app.backend
        state = "generating" if self.generating else self.app.model_state
        name = backend.name if backend else None
        ctx = backend.max_model_len if backend else None
        text = status_text(name, state, self.stats, ctx)
        if self.queued:
            text += f" · {QUEUED}"
        if self.speech_state:
            text += f" · {self.speech_state}"
        text += self.images_status()
        self.query_one("#status", Static).update(text)

    @work(exclusive=True, group="list")
    async def refresh_list(self) -> None:
        sidebar = self.query_one(ConversationList)
        found = self.store.conversations(sidebar.query_text)
        await sidebar.show(found, self.conversation.id if self.conversation else None)

    @on(ConversationList.SearchChanged)
    def _search(self) -> None:
        self.refresh_list()

    # -- sending and streaming -------------------------------------------------------------

    @on(PromptInput.Submitted, "#prompt")
    async def send(self, event: PromptInput.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        if text.startswith("/attach ") or text == "/attach":
            event.input.clear()
            if text == "/attach":
                self.action_attach()
            else:
                self.attach(text.removeprefix("/attach "))
            return
        if text == "/image" or text.startswith("/image "):
            event.input.clear()
            self.image_command(text)
            return
        if text == "/music" or text.startswith("/music "):
            event.input.clear()
            self.make_music(text)
            return
        if self.app.backend is None and not self.app.loading:
            self.notify(f"No model ready ({self.app.model_state}); ctrl+l picks one", timeout=4)
            return
        if self.generating:
            self.notify("Still answering: Esc stops it", severity="warning")
            return
        if self.queued and self.editing is None:
            self.notify("A message already waits for the model", severity="warning")
            return
        event.input.clear()
        if self.editing is not None:
            await self._truncate(self.editing)
            self.editing = None
            event.input.remove_class("editing")
        if self.conversation is None:
            model = self.app.backend.name if self.app.backend else None
            self.conversation = self.store.new_conversation(
                conversation_title(text), self.gen_settings.to_dict(), model
            )
            self.refresh_list()
        text = await self.take_images(text)  # attached images go in front of the text
        msg = self.store.add_message(self.conversation.id, "user", text)  # committed now
        self.history.append(msg)
        await self._mount(MessageView("user", text, msg.id))
        if self.app.backend is None:  # still loading: answered by model_ready
            self.queued = True
            self.refresh_status()
        else:
            self.generate()

    def model_ready(self, ok: bool) -> None:
        """A load ended (`ok`: a backend is ready): answer the queued message, if any. After a
        failed load it stays in the conversation, for ctrl+r once a model is loaded."""
        if not self.queued:
            return
        self.queued = False
        if ok and self.history and self.history[-1].role == "user":
            if self.conversation.model is None:
                self.store.set_model(self.conversation.id, self.app.backend.name)
                self.conversation = self.store.conversation(self.conversation.id)
            self.generate()
        self.refresh_status()

    async def _mount(self, view: MessageView) -> None:
        messages = self.query_one("#messages")
        await messages.mount(view)
        messages.scroll_end(animate=False)

    async def _truncate(self, first: StoredMessage) -> None:
        """Forget `first` and everything after it (store and screen)."""
        self.store.delete_from(first.conversation_id, first.id)
        keep = [m for m in self.history if m.id < first.id]
        self.history = keep
        ids = {m.id for m in keep}
        for view in list(self.query(MessageView)):
            if view.message_id not in ids:
                await view.remove()

    # -- actions ---------------------------------------------------------------------------

    def action_stop(self) -> None:
        if self.generating:
            self.answer_worker.cancel()
        elif self.editing is not None:
            self.editing = None
            prompt = self.query_one(PromptInput)
            prompt.clear()
            prompt.remove_class("editing")
        self.refresh_bindings()

    async def action_regenerate(self) -> None:
        if self.generating or not self.history or self.app.backend is None:
            return
        last = self.history[-1]
        if last.role == "assistant":
            await self._truncate(last)
        if self.history and self.history[-1].role == "user":
            self.generate()

    def action_edit_last(self) -> None:
        users = [m for m in self.history if m.role == "user"]
        if self.generating or not users:
            return
        self.editing = users[-1]
        prompt = self.query_one(PromptInput)
        prompt.value = self.editing.content
        prompt.add_class("editing")
        prompt.focus()
        self.notify("Editing your last message: Enter resends, Esc cancels", timeout=3)
        self.refresh_bindings()

    async def action_new_chat(self) -> None:
        await self.open(None)

    async def open(self, conversation: Conversation | None) -> None:
        """Show `conversation` (None: a fresh, unsaved one); stops a running answer first."""
        await self.stop_answer()
        self.conversation, self.editing, self.stats = conversation, None, None
        self.queued = False  # the message stays in its conversation, for ctrl+r
        base = self.app.config.sampling
        if conversation is not None:
            base = GenSettings.from_dict(conversation.settings, base)
        self.gen_settings = base
        self.history = self.store.messages(conversation.id) if conversation else []
        messages = self.query_one("#messages")
        await messages.remove_children()
        await messages.mount_all(
            MessageView(m.role, m.content, m.id, m.reasoning) for m in self.history
        )
        messages.scroll_end(animate=False)
        self.query_one(PromptInput).focus()
        self.refresh_status()
        self.refresh_list()

    def on_image_dropped(self, event: ImageDropped) -> None:
        event.stop()
        self.attach_image(event.path)

    @on(ConversationList.Selected)
    async def _open_selected(self, event: ConversationList.Selected) -> None:
        await self.open(self.store.conversation(event.conversation.id))

    def action_sampling(self) -> None:
        def done(settings: GenSettings | None) -> None:
            if settings is not None:
                self.gen_settings = settings
                if self.conversation is not None:
                    self.store.set_settings(self.conversation.id, settings.to_dict())

        self.app.push_screen(SamplingModal(self.gen_settings), done)

    def action_toggle_sidebar(self) -> None:
        side = self.query_one("#side")
        side.display = not side.display
