"""Chat-screen image attachments: `/image PATH` (or the palette's "Attach image", or a dropped
image file) attaches an image to the next message; the status line lists what is attached, and
sending copies them into the history's image folder and puts them in the message
(`app/tui/images`). `/image` alone clears the attachments.

A mixin of `ChatScreen` (which provides `refresh_status` and `store`).
"""

import asyncio
from pathlib import Path

from localllm.app.tui.images import MAX_IMAGES, image_path, keep_image, with_images
from localllm.app.tui.screens.modals import TextPromptModal


class ImageActions:
    pending_images: list[Path]

    def image_command(self, text: str) -> None:
        """`/image PATH` attaches; `/image` alone clears what is attached."""
        arg = text.removeprefix("/image").strip()
        if not arg:
            self.pending_images = []
            self.notify("Attached images cleared", timeout=2)
            self.refresh_status()
            return
        self.attach_image(arg)

    def action_attach_image(self) -> None:
        def done(path: str | None) -> None:
            if path:
                self.attach_image(path)

        self.app.push_screen(TextPromptModal("Attach an image to the next message"), done)

    def attach_image(self, text: str | Path) -> bool:
        path = image_path(str(text))
        if path is None:
            self.notify(f"{text}: not an image file (png, jpg, webp, gif, bmp, tiff)",
                        title="Cannot attach", severity="error")  # fmt: skip
            return False
        if len(self.pending_images) >= MAX_IMAGES:
            self.notify(f"At most {MAX_IMAGES} images per message", severity="warning")
            return False
        self.pending_images = [*self.pending_images, path]
        self.notify(f"Attached {path.name}: it goes with your next message", timeout=3)
        self.refresh_status()
        return True

    async def take_images(self, text: str) -> str:
        """The message text with the pending images attached, as the history's copies (none
        pending after); an image that cannot be kept is dropped with a notice."""
        paths, self.pending_images = self.pending_images, []
        folder = self.store.path.parent / "images"
        kept = []
        for p in paths:
            try:
                kept.append(await asyncio.to_thread(keep_image, p, folder))
            except ValueError as e:
                self.notify(str(e), title="Image not sent", severity="error")
        return with_images(text, kept)

    def images_status(self) -> str:
        if not self.pending_images:
            return ""
        return " · 🖼 " + ", ".join(p.name for p in self.pending_images)
