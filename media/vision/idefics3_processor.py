"""Idefics3 / SmolVLM image preprocessing and prompt layout, equal to transformers'
`Idefics3ImageProcessor` (PIL backend) and `Idefics3Processor`.

An image is resized so its longest edge is `preproc_size` (even short edge), resized again up
to whole tiles of the tower's `image_size`, cut into rows x cols tiles (row-major) plus one global
view resized to a single tile; every resize is Pillow's LANCZOS on uint8 pixels. Pixels are then
rescaled by 1/255 (in float64, stored as float32) and normalized with the mmproj's mean/std.
In the prompt each tile is `<fake_token_around_image><row_R_col_C>` + `<image>` x tokens, a
newline after each row, then `\\n<fake_token_around_image><global-img>` + `<image>` x tokens +
`<fake_token_around_image>` for the global view (an image of one tile has only that last part).
"""

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from localllm.media.vision import video_smolvlm
from localllm.media.vision.idefics3 import ModelArgs

MAX_IMAGE_SIZE = 4096  # transformers' absolute cap on the resized longest edge
RESCALE = 1 / 255
FAKE, IMAGE, GLOBAL = "<fake_token_around_image>", "<image>", "<global-img>"


@dataclass(frozen=True, slots=True)
class Layout:
    rows: int  # 0 when the image is a single tile (no split)
    cols: int

    @property
    def tiles(self) -> int:
        return self.rows * self.cols + 1


class Processor:
    image_token = IMAGE
    video_token = "<video>"  # SmolVLM2's template writes it; its frames become images
    special_tokens = (FAKE, IMAGE, GLOBAL)  # the vocabulary must have each as one token

    def __init__(self, args: ModelArgs):
        self.args = args
        # SmolVLM2 video sampling (`video_smolvlm`): frames a second, at most, longest edge
        self.video_fps = video_smolvlm.FPS
        self.video_max_frames = video_smolvlm.MAX_FRAMES
        self.video_size = video_smolvlm.VIDEO_SIZE
        self.tile = args.tower.image_size
        self.mean = np.array(args.image_mean, dtype=np.float32)
        self.std = np.array(args.image_std, dtype=np.float32)
        # what else shapes the embeddings of given pixels (content hashes include it)
        self.salt = f"idefics3:{args.preproc_size}:{self.tile}:{args.image_mean}:{args.image_std}"

    def preprocess(self, img: Image.Image) -> tuple[np.ndarray, Layout]:
        """An RGB image -> (pixel values [tiles, 3, S, S] float32, its tile layout)."""
        w, h = img.size
        h, w = _fit_longest(h, w, self.args.preproc_size)
        h, w = _scale_below(h, w, MAX_IMAGE_SIZE)
        img = img.resize((w, h), Image.Resampling.LANCZOS)
        h, w = _whole_tiles(h, w, self.tile)
        img = img.resize((w, h), Image.Resampling.LANCZOS)
        t = self.tile
        if h > t or w > t:
            rows, cols = (h - t) // t + 1, (w - t) // t + 1
            tiles = [img.crop((c * t, r * t, c * t + t, r * t + t))
                     for r in range(rows) for c in range(cols)]  # fmt: skip
            tiles.append(img.resize((t, t), Image.Resampling.LANCZOS))
        else:
            rows = cols = 0
            tiles = [img]
        px = np.stack([np.asarray(x, dtype=np.uint8).transpose(2, 0, 1) for x in tiles])
        px = (px.astype(np.float64) * RESCALE).astype(np.float32)
        px = (px - self.mean[:, None, None]) / self.std[:, None, None]
        return px, Layout(rows, cols)

    def sample_frames(self, total: int, fps: float, limits) -> list[int]:
        return video_smolvlm.sample(
            total, fps, self.video_fps, min(self.video_max_frames, limits.max_frames)
        )

    def preprocess_video(self, video) -> tuple[np.ndarray, video_smolvlm.Frames]:
        """A decoded `video.Video` -> (one tile per frame [n, 3, S, S], its frames' times)."""
        a = self.args
        px = video_smolvlm.preprocess(video.frames, self.video_size, self.tile, a.image_mean,
                                      a.image_std)  # fmt: skip
        stamps = tuple(i / video.fps for i in video.indices)
        return px, video_smolvlm.Frames(stamps, video.total / video.fps)

    def num_tokens(self, layout: Layout) -> int:
        return layout.tiles * self.args.tokens_per_tile

    def placeholder(self, layout: Layout) -> str:
        """The text that stands for one image in the prompt (its `<image>` tokens in order)."""
        run = IMAGE * self.args.tokens_per_tile
        glob = f"{FAKE}{GLOBAL}{run}{FAKE}"
        if isinstance(layout, video_smolvlm.Frames):  # a video: each frame one global view
            return video_smolvlm.placeholder(layout, glob)
        if layout.rows == 0:
            return glob
        text = "".join(
            "".join(f"{FAKE}<row_{r + 1}_col_{c + 1}>{run}" for c in range(layout.cols)) + "\n"
            for r in range(layout.rows)
        )
        return f"{text}\n{glob}"

    def layout_tokens(self, layout: Layout) -> tuple[str, ...]:
        """Tokens of the placeholder beyond `special_tokens` (row/col tags), to check."""
        return tuple(f"<row_{r + 1}_col_{c + 1}>" for r in range(layout.rows)
                     for c in range(layout.cols))  # fmt: skip


def _fit_longest(h: int, w: int, longest: int) -> tuple[int, int]:
    """transformers' `_resize_output_size_rescale_to_max_len`: the longest edge to `longest`,
    the other kept in ratio and made even."""
    aspect = w / h
    if w >= h:
        w = longest
        h = int(w / aspect)
        h += h % 2
    else:
        h = longest
        w = int(h * aspect)
        w += w % 2
    return max(h, 1), max(w, 1)


def _scale_below(h: int, w: int, top: int) -> tuple[int, int]:
    aspect = w / h
    if w >= h and w > top:
        w, h = top, int(top / aspect)
    elif h > w and h > top:
        h, w = top, int(top * aspect)
    return max(h, 1), max(w, 1)


def _whole_tiles(h: int, w: int, tile: int) -> tuple[int, int]:
    """transformers' `resize_for_vision_encoder`: both sides up to a multiple of the tile."""
    aspect = w / h
    if w >= h:
        w = math.ceil(w / tile) * tile
        h = math.ceil(int(w / aspect) / tile) * tile
    else:
        h = math.ceil(h / tile) * tile
        w = math.ceil(int(h * aspect) / tile) * tile
    return h, w
