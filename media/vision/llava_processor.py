"""LLaVA-1.5 and LLaVA-1.6 image preprocessing and prompt layout, equal to transformers'
`LlavaImageProcessorPil` / `CLIPImageProcessor` (llava-1.5-hf's settings: no padding to a
square) and `LlavaProcessor`, and `LlavaNextImageProcessorPil` / `LlavaNextProcessor`.

The image's shortest edge is resized to the tower's `image_size` (336 for the released models)
with Pillow's BICUBIC on uint8 pixels, the other edge in ratio (truncated); the centre
`image_size` square is cropped (offsets rounded down); pixels are rescaled by 1/255 (in float64,
stored as float32) and normalized with the mmproj's mean/std. The chat template writes `<image>`
for an image; the processor repeats it once per patch ((336/14)^2 = 576 for the released ones).

LLaVA-1.6 (grid pinpoints in the mmproj): the grid resolution that keeps most of the image and
wastes least is picked; the image is resized into it keeping its ratio (BICUBIC), centred on
black padding, and cut into tiles row by row; the base view is the whole image resized to one
tile (not cropped); every view is then processed as above. The prompt holds one `<image>` per
base-view patch, per tile-map position that is not padding, and per row (the newline).
"""

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from localllm.media.vision.llava import ModelArgs, unpad_box

RESCALE = 1 / 255
IMAGE = "<image>"


@dataclass(frozen=True, slots=True)
class Layout:
    """A LLaVA-1.6 image: its tile grid and its size before preprocessing."""

    rows: int
    cols: int
    height: int
    width: int


class Processor:
    image_token = IMAGE
    special_tokens = (IMAGE,)

    def __init__(self, args: ModelArgs):
        self.args = args
        self.size = args.tower.image_size
        self.mean = np.array(args.image_mean, dtype=np.float32)
        self.std = np.array(args.image_std, dtype=np.float32)
        # what else shapes the embeddings of given pixels (content hashes include it)
        self.salt = f"llava:{self.size}:{args.image_mean}:{args.image_std}:{args.pinpoints}"

    def preprocess(self, img: Image.Image) -> tuple[np.ndarray, Layout | None]:
        """An RGB image -> (pixel values [views, 3, S, S] float32, its layout: None for one
        view, a `Layout` for LLaVA-1.6's base view + tiles)."""
        if self.args.pinpoints:
            return self._anyres(img)
        return self._normalize(self._crop(img)[None]), None

    def _crop(self, img: Image.Image) -> np.ndarray:
        """Shortest edge to S, the centre S x S: uint8 [3, S, S]."""
        s = self.size
        w, h = img.size
        if w <= h:
            w, h = s, int(s * h / w)
        else:
            w, h = int(s * w / h), s
        img = img.resize((w, h), Image.Resampling.BICUBIC)
        top, left = (h - s) // 2, (w - s) // 2
        return np.asarray(img, dtype=np.uint8)[top : top + s, left : left + s].transpose(2, 0, 1)

    def _normalize(self, px: np.ndarray) -> np.ndarray:
        px = (px.astype(np.float64) * RESCALE).astype(np.float32)
        return (px - self.mean[:, None, None]) / self.std[:, None, None]

    def _anyres(self, img: Image.Image) -> tuple[np.ndarray, Layout]:
        s, (w, h) = self.size, img.size
        th, tw = best_resolution(h, w, self.args.pinpoints)
        nh, nw = fitted(h, w, th, tw)
        fit = np.asarray(img.resize((nw, nh), Image.Resampling.BICUBIC), dtype=np.uint8)
        y, x = (th - nh) // 2, (tw - nw) // 2
        canvas = np.zeros((th, tw, 3), dtype=np.uint8)  # black padding, as np.pad with 0
        canvas[y : y + nh, x : x + nw] = fit
        tiles = [canvas[r : r + s, c : c + s] for r in range(0, th, s) for c in range(0, tw, s)]
        base = np.asarray(img.resize((s, s), Image.Resampling.BICUBIC), dtype=np.uint8)
        px = np.stack([v.transpose(2, 0, 1) for v in [base, *tiles]])
        return self._normalize(px), Layout(th // s, tw // s, h, w)

    def num_tokens(self, layout: Layout | None) -> int:
        n = self.args.tokens_per_image
        if layout is None:
            return n
        side = self.args.tower.patches_per_side
        cur_h, cur_w = layout.rows * side, layout.cols * side
        top, bottom, left, right = unpad_box(layout.height, layout.width, cur_h, cur_w)
        rows = bottom - top
        return n + rows * (right - left) + rows

    def placeholder(self, layout: Layout | None) -> str:
        return IMAGE * self.num_tokens(layout)

    def layout_tokens(self, layout: None) -> tuple[str, ...]:
        return ()


def best_resolution(h: int, w: int, pinpoints) -> tuple[int, int]:
    """transformers' `select_best_resolution`: the (height, width) that keeps most of the image
    (downscaled to fit), then wastes least."""
    best, most, waste = pinpoints[0], 0, math.inf
    for ph, pw in pinpoints:
        scale = min(pw / w, ph / h)
        kept = min(int(w * scale) * int(h * scale), w * h)
        wasted = ph * pw - kept
        if kept > most or (kept == most and wasted < waste):
            best, most, waste = (ph, pw), kept, wasted
    return best


def fitted(h: int, w: int, th: int, tw: int) -> tuple[int, int]:
    """transformers' `get_patch_output_size`: the size an h x w image takes inside th x tw."""
    if tw / w < th / h:
        return min(math.ceil(h * (tw / w)), th), tw
    return th, min(math.ceil(w * (th / h)), tw)
