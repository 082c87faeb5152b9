"""Qwen3-VL preprocessing and prompt layout: images as Qwen2.5-VL's (`qwen25vl_processor`, with
16-px patches from the mmproj, so sides are multiples of 32, and Qwen3-VL's pixel bounds);
videos as transformers' `Qwen3VLVideoProcessor` and `Qwen3VLProcessor`.

A video's frames are sampled evenly from first to last (`video.sample_linspace`), resized
together (the pixel budget counts all frames, with qwen-vl-utils' per-frame cap), normalized and
cut into temporal patches of two frames. In the prompt each temporal patch is its own span,
preceded by its time: `<1.5 seconds><|vision_start|><|video_pad|>...<|vision_end|>` (the mean
time of its two frames), and the chat template's `<|vision_start|><|video_pad|><|vision_end|>`
wrapper is replaced by the whole sequence. For M-RoPE each temporal patch is an image of its own
(the timestamps carry the time).
"""

import math
from dataclasses import dataclass

import numpy as np

from localllm.media.vision import qwen25vl_processor as base
from localllm.media.vision.qwen25vl import MERGE, TEMPORAL
from localllm.media.vision.qwen25vl_processor import END, START, VIDEO, Grid
from localllm.media.vision.video import sample_linspace

# transformers' defaults (Qwen3-VL preprocessor_config.json; Qwen3VLVideoProcessor): docs/vision.md
MIN_PIXELS = 65_536
MAX_PIXELS = 16_777_216
VIDEO_MIN_PIXELS = 128 * 32 * 32
VIDEO_MAX_PIXELS = 768 * 32 * 32
MAX_FRAME_TOKENS = 768  # qwen-vl-utils' per-frame cap (VIDEO_MAX_TOKEN_NUM)


@dataclass(frozen=True, slots=True)
class VideoGrid:
    t: int
    h: int
    w: int
    stamps: tuple[float, ...]  # each temporal patch's time, seconds

    @property
    def thw(self) -> tuple[int, int, int]:
        return self.t, self.h, self.w


def smart_resize_video(n, height, width, factor, min_pixels, max_pixels) -> tuple[int, int]:
    """`video_processing_qwen3_vl.smart_resize`: the pixel bounds count all frames."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > base.MAX_ASPECT:
        raise ValueError(f"the video's aspect ratio {max(height, width) / min(height, width):.0f}")
    hb, wb = round(height / factor) * factor, round(width / factor) * factor
    tb = round(n / TEMPORAL) * TEMPORAL
    if tb * hb * wb > max_pixels:
        beta = math.sqrt(n * height * width / max_pixels)
        hb = max(factor, math.floor(height / beta / factor) * factor)
        wb = max(factor, math.floor(width / beta / factor) * factor)
    elif tb * hb * wb < min_pixels:
        beta = math.sqrt(min_pixels / (n * height * width))
        hb, wb = (
            math.ceil(height * beta / factor) * factor,
            math.ceil(width * beta / factor) * factor,
        )
    return hb, wb


class Processor(base.Processor):
    video_wrapper = START + VIDEO + END  # the template's; a video's placeholder replaces it

    def __init__(
        self,
        args,
        min_pixels: int = MIN_PIXELS,
        max_pixels: int = MAX_PIXELS,
        video_min_pixels: int = VIDEO_MIN_PIXELS,
        video_max_pixels: int = VIDEO_MAX_PIXELS,
        **kw,
    ):
        super().__init__(args, min_pixels, max_pixels, video_min_pixels, video_max_pixels, **kw)
        self.salt = "qwen3vl:" + self.salt

    @staticmethod
    def sample_frames(total: int, fps: float, limits) -> list[int]:
        return sample_linspace(total, fps, limits)

    def preprocess_video(self, video) -> tuple[np.ndarray, VideoGrid]:
        frames = video.frames
        n = len(frames)
        h, w = self.video_frame_size(n, *base.source_size(video))
        patches, (t, gh, gw) = self.video_patches(frames, h, w)
        idx = list(video.indices) + [video.indices[-1]] * (-n % TEMPORAL)
        secs = [i / video.fps for i in idx]
        stamps = tuple(
            (secs[i] + secs[i + TEMPORAL - 1]) / 2 for i in range(0, len(secs), TEMPORAL)
        )
        return patches, VideoGrid(t, gh, gw, stamps)

    def video_frame_size(self, n: int, height: int, width: int) -> tuple[int, int]:
        """The (height, width) `n` sampled frames are resized to: the pixel budget counts all
        frames, with qwen-vl-utils' per-frame cap."""
        per_frame = max(
            min(MAX_FRAME_TOKENS * self.factor**2, self.video_max_pixels // n),
            int(self.video_min_pixels * 1.05),
        )
        return smart_resize_video(n, height, width, self.factor, self.video_min_pixels,
                                  per_frame * n)  # fmt: skip

    def placeholder(self, grid) -> str:
        if not isinstance(grid, VideoGrid):
            return super().placeholder(grid)
        run = VIDEO * (grid.h * grid.w // MERGE**2)
        return "".join(f"<{s:.1f} seconds>{START}{run}{END}" for s in grid.stamps)

    def segments(self, grid) -> list[int] | None:
        """A video's placeholder tokens per temporal patch (separate spans), None for an image."""
        if not isinstance(grid, VideoGrid):
            return None
        return [grid.h * grid.w // MERGE**2] * grid.t

    def rope(self, grid):
        if isinstance(grid, VideoGrid):  # one temporal patch (a segment): an image of its own
            grid = Grid(1, grid.h, grid.w)
        return super().rope(grid)
