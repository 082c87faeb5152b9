"""SmolVLM2 video: frames as single-tile images, equal to transformers' `SmolVLMVideoProcessor`
and the video prompt of `SmolVLMProcessor` (used by the `idefics3` family's processor).

Frames are sampled `fps` a second (SmolVLM2: 1, at most 64), evenly from first to last, skipping
the first and last second of long videos; each is resized so its longest edge is `video_size`
(even short edge), then squared to one tile (no splitting), both by torch's antialiased Lanczos
on uint8 (what torchvision does on CPU), and normalized with mean and std scaled by 255 in
float32. The prompt: "You are provided the following series of four frames from a 0:00:02
[H:MM:SS] video.\\n", then per frame "\\nFrame from MM:SS:" and the frame's global-image tokens,
then "\\n\\n".
"""

from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.nn.functional as F

INTRO = "You are provided the following series of {n} frames from a {duration} [H:MM:SS] video.\n"
FRAME = "\nFrame from {stamp}:"
OUTRO = "\n\n"
MAX_SIDE = 4096  # transformers' absolute cap on video_size
SKIP_SECS = 1
# SmolVLM2's video_sampling defaults (processor_config.json), documented in docs/vision.md
FPS = 1.0
MAX_FRAMES = 64
VIDEO_SIZE = 384


@dataclass(frozen=True, slots=True)
class Frames:
    stamps: tuple[float, ...]  # each sampled frame's time, seconds
    duration: float  # the video's, seconds

    @property
    def tiles(self) -> int:
        return len(self.stamps)


def sample(total: int, fps: float, target_fps: float, max_frames: int) -> list[int]:
    """`SmolVLMVideoProcessor.sample_frames` for `total` frames at `fps`."""
    duration = total / fps
    n = max(1, min(round(target_fps * duration), max_frames))
    start, end = 0, total - 1
    if SKIP_SECS > 0 and duration - 2 * SKIP_SECS > max_frames * target_fps:
        start, end = int(SKIP_SECS * fps), int(total - SKIP_SECS * fps)
    start, end = max(0, start), min(end, total - 1)
    if start >= end:
        start, end = 0, total - 1
    return np.unique(np.linspace(start, end, n, dtype=int)).tolist()


def preprocess(frames: np.ndarray, video_size: int, tile: int, mean, std) -> np.ndarray:
    """Sampled RGB frames [n, H, W, 3] uint8 -> tiles [n, 3, tile, tile] float32."""
    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
    h, w = _longest_edge(x.shape[2], x.shape[3], min(MAX_SIDE, video_size))
    for size in ((h, w), (tile, tile)):
        if tuple(x.shape[2:]) != size:
            x = F.interpolate(x, size=list(size), mode="lanczos", align_corners=False,
                              antialias=True)  # fmt: skip
    m = torch.tensor(mean) * 255.0
    s = torch.tensor(std) * 255.0
    return ((x.to(torch.float32) - m[:, None, None]) / s[:, None, None]).numpy()


def placeholder(layout: Frames, frame_text: str) -> str:
    """The prompt text of a video whose every frame is `frame_text` (its image tokens)."""
    try:
        from num2words import num2words
    except ImportError:
        raise ValueError(
            "SmolVLM2 video prompts need num2words: pip install 'localllm[video]'"
        ) from None

    text = INTRO.format(n=num2words(layout.tiles), duration=timedelta(seconds=int(layout.duration)))
    for t in layout.stamps:
        text += FRAME.format(stamp=f"{int(t // 60):02d}:{int(t % 60):02d}") + frame_text
    return text + OUTRO


def _longest_edge(h: int, w: int, side: int) -> tuple[int, int]:
    aspect = w / h
    if w >= h:
        w, h = side, int(side / aspect)
        h += h % 2
    else:
        h, w = side, int(side * aspect)
        w += w % 2
    return max(h, 1), max(w, 1)
