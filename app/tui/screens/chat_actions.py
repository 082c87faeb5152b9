"""Chat-screen actions on the conversation as a whole: rename, delete (and its kept images that
no other message names), export, copy an answer.

A mixin of `ChatScreen` (which provides `conversation`, `history`, `store`, `open`, `refresh_list`).
"""

import asyncio
import re

from localllm.app.tui.history import slug
from localllm.app.tui.images import prune_kept
from localllm.app.tui.screens.modals import ConfirmModal, TextPromptModal

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


def last_code_block(text: str) -> str | None:
    """The body of the last fenced code block in `text` (what "copy" takes), if any."""
    blocks = FENCE.findall(text)
    return blocks[-1] if blocks else None


class ConversationActions:
    def action_rename(self) -> None:
        conv = self.conversation
        if conv is None:
            return

        def done(title: str | None) -> None:
            if title:
                self.store.rename(conv.id, title)
                self.conversation = self.store.conversation(conv.id)
                self.refresh_list()

        self.app.push_screen(TextPromptModal("Rename conversation", conv.title), done)

    def action_delete(self) -> None:
        conv = self.conversation
        if conv is None:
            return

        async def done(yes: bool | None) -> None:
            if yes:
                self.store.delete(conv.id)
                await self.open(None)
                folder = self.store.path.parent / "images"  # its images no message names
                await asyncio.to_thread(prune_kept, self.store, folder)

        self.app.push_screen(ConfirmModal(f"Delete “{conv.title}”?"), done)

    def action_export(self) -> None:
        if self.conversation is None:
            return
        path = self.app.export_dir / f"{slug(self.conversation.title)}.md"
        path.write_text(self.store.export_markdown(self.conversation.id))
        self.notify(f"Exported to {path}", timeout=5)

    def action_copy_answer(self) -> None:
        answers = [m for m in self.history if m.role == "assistant"]
        if answers:
            code = last_code_block(answers[-1].content)
            self.app.copy_to_clipboard(code if code is not None else answers[-1].content)
            self.notify("Copied the last code block" if code is not None else "Copied the answer")
