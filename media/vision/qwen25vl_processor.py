"""Qwen2-VL / Qwen2.5-VL preprocessing and prompt layout, equal to transformers'
`Qwen2VLImageProcessorPil` (images) and `Qwen2VLVideoProcessor` (videos), and the M-RoPE
positions of `get_rope_index`.

`smart_resize` picks a size whose sides are multiples of patch x merge (28) with the pixel count
inside [min_pixels, max_pixels], keeping the aspect ratio. An image is resized by Pillow's BICUBIC
on uint8, rescaled by 1/255 in float64 (stored float32), normalized, and cut into patches in
merge-block order, each patch repeated for the two frames of a temporal patch. Video frames are
resized together by torch's antialiased bicubic on uint8 (what torchvision does on CPU),
normalized with mean and std scaled by 255 in float32, padded to an even count with the last
frame and cut the same way, two frames per temporal patch. In the prompt, an image is the chat
template's `<|vision_start|><|image_pad|><|vision_end|>` with `<|image_pad|>` repeated once per
merged unit (`<|video_pad|>` for a video).
"""

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from localllm.media.vision.qwen25vl import MERGE, TEMPORAL, ModelArgs

IMAGE, VIDEO = "<|image_pad|>", "<|video_pad|>"
START, END = "<|vision_start|>", "<|vision_end|>"
RESCALE = 1 / 255
# transformers' defaults (Qwen2.5-VL's preprocessor_config.json): documented in docs/vision.md;
# a model's own settings replace them (`preprocess_config`, through `VisionPipeline`)
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 1280
VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28
MAX_VIDEO_TOKENS = 128_000  # the total-video pixel budget, in tokens (qwen-vl-utils' cap)
MAX_ASPECT = 200


@dataclass(frozen=True, slots=True)
class Grid:
    t: int  # temporal patches
    h: int  # patch rows
    w: int  # patch columns
    seconds: float = 0.0  # a video's seconds per temporal patch (0: an image)

    @property
    def thw(self) -> tuple[int, int, int]:
        return self.t, self.h, self.w


def smart_resize(h: int, w: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' `smart_resize`: sides multiples of `factor`, pixels within the bounds."""
    if max(h, w) / min(h, w) > MAX_ASPECT:
        raise ValueError(f"the image's aspect ratio {max(h, w) / min(h, w):.0f} is above 200")
    hb, wb = round(h / factor) * factor, round(w / factor) * factor
    if hb * wb > max_pixels:
        beta = math.sqrt(h * w / max_pixels)
        hb = max(factor, math.floor(h / beta / factor) * factor)
        wb = max(factor, math.floor(w / beta / factor) * factor)
    elif hb * wb < min_pixels:
        beta = math.sqrt(min_pixels / (h * w))
        hb, wb = math.ceil(h * beta / factor) * factor, math.ceil(w * beta / factor) * factor
    return hb, wb


def source_size(video) -> tuple[int, int]:
    """The file's frame (height, width): the decoder may have resized the frames already."""
    return tuple(video.source) if video.source[0] else video.frames.shape[1:3]


class Processor:
    image_token = IMAGE
    video_token = VIDEO
    special_tokens = (IMAGE, VIDEO, START, END)  # the vocabulary must have each as one token

    def __init__(
        self,
        args: ModelArgs,
        min_pixels: int = MIN_PIXELS,
        max_pixels: int = MAX_PIXELS,
        video_min_pixels: int = VIDEO_MIN_PIXELS,
        video_max_pixels: int = VIDEO_MAX_PIXELS,
        tokens_per_second: float = 2.0,
    ):
        self.args = args
        self.patch = args.patch_size
        self.factor = self.patch * MERGE
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.video_min_pixels, self.video_max_pixels = video_min_pixels, video_max_pixels
        self.tokens_per_second = tokens_per_second
        self.mean = np.array(args.image_mean, dtype=np.float32)
        self.std = np.array(args.image_std, dtype=np.float32)
        # what else shapes the embeddings of given pixels (content hashes include it)
        self.salt = (f"qwen25vl:{min_pixels}:{max_pixels}:{video_min_pixels}:{video_max_pixels}:"
                     f"{args.image_mean}:{args.image_std}")  # fmt: skip

    def preprocess(self, img: Image.Image) -> tuple[np.ndarray, Grid]:
        """An RGB image -> (patches [h*w, 3*2*p*p] float32, its grid)."""
        h, w = smart_resize(img.height, img.width, self.factor, self.min_pixels, self.max_pixels)
        img = img.resize((w, h), Image.Resampling.BICUBIC)
        px = np.asarray(img, dtype=np.uint8).transpose(2, 0, 1)
        px = (px.astype(np.float64) * RESCALE).astype(np.float32)
        px = (px - self.mean[:, None, None]) / self.std[:, None, None]
        frames = np.broadcast_to(px[None], (TEMPORAL, *px.shape))
        patches, grid = self._patchify(frames)
        return patches, Grid(1, *grid)

    def preprocess_video(self, video) -> tuple[np.ndarray, Grid]:
        """A decoded `video.Video` (sampled RGB frames [T, H, W, 3] uint8) -> (patches, grid)."""
        frames = video.frames
        h, w = self.video_frame_size(len(frames), *source_size(video))
        patches, grid = self.video_patches(frames, h, w)
        return patches, Grid(*grid, seconds=TEMPORAL / video.sampled_fps)

    def video_frame_size(self, n: int, height: int, width: int) -> tuple[int, int]:
        """The (height, width) `n` sampled frames of height x width are resized to (the decoder
        resizes each frame to it as it comes: `video.decode_video(resize=)`)."""
        budget = int(MAX_VIDEO_TOKENS * self.factor * self.factor * 0.9)
        top = max(min(self.video_max_pixels, budget * TEMPORAL // n),
                  int(self.video_min_pixels * 1.05))  # fmt: skip
        return smart_resize(height, width, self.factor, self.video_min_pixels, top)

    def video_patches(self, frames: np.ndarray, h: int, w: int):
        """Frames resized to h x w (torch's antialiased bicubic on uint8; frames the decoder
        resized already stay), normalized, padded to whole temporal patches (the last frame
        again) and cut -> (patches, (t, gh, gw)). One temporal patch is made float at a time,
        written into the output: the peak is the output, not twice the frames in float."""
        n, height, width = frames.shape[:3]
        x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
        if (h, w) != (height, width):
            x = F.interpolate(x, size=[h, w], mode="bicubic", align_corners=False, antialias=True)
        mean = (torch.tensor(self.args.image_mean) * (1.0 / RESCALE))[:, None, None]
        std = (torch.tensor(self.args.image_std) * (1.0 / RESCALE))[:, None, None]
        t, rows = -(-n // TEMPORAL), (h // self.patch) * (w // self.patch)
        out = np.empty((t * rows, 3 * TEMPORAL * self.patch**2), np.float32)
        for g in range(t):
            pick = [min(g * TEMPORAL + k, n - 1) for k in range(TEMPORAL)]
            group = ((x[pick].to(torch.float32) - mean) / std).numpy()
            out[g * rows : (g + 1) * rows], grid = self._patchify(group)
        return out, (t, *grid)

    def _patchify(self, frames: np.ndarray) -> tuple[np.ndarray, tuple[int, int]]:
        """Two frames [2, C, H, W] -> patches [gh*gw, C*2*p*p] in merge-block order."""
        t, c, h, w = frames.shape
        p, m = self.patch, MERGE
        gh, gw = h // p, w // p
        x = frames.reshape(t, c, gh // m, m, p, gw // m, m, p)
        x = x.transpose(2, 5, 3, 6, 1, 0, 4, 7)  # (gh, gw, mh, mw, C, T, ph, pw)
        return np.ascontiguousarray(x).reshape(gh * gw, c * t * p * p), (gh, gw)

    def num_tokens(self, grid: Grid) -> int:
        return grid.t * grid.h * grid.w // MERGE**2

    def placeholder(self, grid: Grid) -> str:
        """The text that stands for one image or video (the template writes the start/end)."""
        return (VIDEO if grid.seconds else IMAGE) * self.num_tokens(grid)

    def time_step(self, grid: Grid) -> float:
        """How far a video's temporal positions move per temporal patch (its seconds, in
        `tokens_per_second`: Qwen2.5-VL's absolute time); 1 for an image."""
        return self.tokens_per_second * grid.seconds if grid.seconds else 1

    def rope(self, grid: Grid) -> tuple[torch.Tensor, int]:
        """M-RoPE offsets [3, tokens] of an item's placeholders (temporal, row, column from
        where the text stopped) and how far the text after it moves on (`get_rope_index`)."""
        t, h, w = grid.t, grid.h // MERGE, grid.w // MERGE
        tt = (torch.arange(t) * self.time_step(grid)).long()
        a, b, c = torch.meshgrid(tt, torch.arange(h), torch.arange(w), indexing="ij")
        return torch.stack((a, b, c)).reshape(3, -1), max(h, w)
