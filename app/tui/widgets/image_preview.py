"""A small preview of an attached image in the transcript, drawn with half blocks: each cell is
`▀` with the upper pixel as its foreground colour and the lower one as its background, so a
cell shows two pixels in any terminal with colour (Textual maps the colours to what the terminal
has). The image is decoded (bounded, `media.vision.image`) and shrunk in a thread worker (a
large file must not stall the screen); a file that cannot be read shows nothing (its chip
stays), and so does a terminal without colour (`NO_COLOR`).
"""

from pathlib import Path

import numpy as np
from textual.content import Content
from textual.widgets import Static

from localllm.media.vision.image import thumbnail

COLS, ROWS = 24, 8  # the largest preview, in cells (documented in docs/tui.md)
HALF = "\u2580"  # upper half block


def pixels(path: Path, cols: int = COLS, rows: int = ROWS) -> np.ndarray:
    """The image shrunk (aspect kept) to fit `cols` x 2 `rows` pixels: RGB [h, w, 3]."""
    return thumbnail(Path(path).read_bytes(), cols, rows * 2)


def half_blocks(px: np.ndarray) -> Content:
    """The picture as lines of half blocks (an odd last pixel row over black)."""
    if len(px) % 2:
        px = np.concatenate((px, np.zeros_like(px[:1])))
    parts: list = []
    for y in range(0, len(px), 2):
        if y:
            parts.append("\n")
        for top, low in zip(px[y].tolist(), px[y + 1].tolist(), strict=True):
            parts.append((HALF, "rgb({},{},{}) on rgb({},{},{})".format(*top, *low)))
    return Content.assemble(*parts)


class ImagePreview(Static):
    DEFAULT_CSS = "ImagePreview { width: auto; height: auto; margin: 0 1 0 0; }"

    def __init__(self, path: Path) -> None:
        super().__init__("")
        self.path = path
        self.shown: np.ndarray | None = None  # the pixels drawn, once drawn

    def on_mount(self) -> None:
        if getattr(self.app, "no_color", False):
            self.display = False
            return
        self.run_worker(self._draw, thread=True, group="preview")

    def _draw(self) -> None:
        try:
            px = pixels(self.path)
        except (OSError, ValueError):  # gone, unreadable, not an image we take
            self.app.call_from_thread(setattr, self, "display", False)
            return
        self.app.call_from_thread(self._show, px, half_blocks(px))

    def _show(self, px: np.ndarray, content: Content) -> None:
        self.shown = px
        self.update(content)
