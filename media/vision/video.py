"""Video input: bytes of an MP4/WebM/MKV/MOV/AVI/GIF file to sampled RGB frames, bounded (the
family's processor preprocesses them: `VisionPipeline.prepare_video`).

Decoding is PyAV (FFmpeg). Frames are sampled as transformers' `Qwen2VLVideoProcessor` does:
`fps` frames per second of video, at least `min_frames` and at most `max_frames`, rounded down
to a multiple of the temporal patch, at indices `arange(0, total, total / n)`. Limits are checked
on the container header before any frame is decoded: bytes, duration, frame size, and the
sampled frames' decoded bytes. The work is bounded too: only the sampled frames are kept, each
resized as soon as it is decoded to the size the family's processor gives it (`resize=`; Qwen:
within its pixel budget, so the memory is that budget, not the file's frame size), and a sampled
frame more than `SEEK_GAP` frames past the last one decoded is reached by seeking to the
keyframe before it, so a long video costs about (sampled frames x keyframe interval) decodes,
not its whole length (a container without a frame count is counted by its packets, undecoded).
Errors are `VideoError` (a ValueError) with one line that says what is wrong.
"""

import hashlib
import io
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from localllm.media.vision.image import ImageError


class VideoError(ImageError):
    """The input is not a video we take (corrupt, too long, too large, no video stream)."""


@dataclass(frozen=True, slots=True)
class VideoLimits:
    """Bounds and sampling of one input video (defaults documented in docs/vision.md)."""

    max_bytes: int = 200 * 1024 * 1024  # the encoded file
    max_seconds: float = 4 * 3600.0  # its duration, from the header
    max_pixels: int = 8192 * 8192  # one frame's width x height
    max_frames_bytes: int = 2 << 30  # the sampled frames as decoded RGB, before any resize
    fps: float = 2.0  # frames sampled per second of video
    min_frames: int = 4
    max_frames: int = 768


DEFAULT_LIMITS = VideoLimits()
SEEK_GAP = 64  # frames decoded in order before a seek to the next sampled one pays off


@dataclass(frozen=True, slots=True)
class Video:
    frames: np.ndarray  # sampled frames [n, H, W, 3] uint8
    fps: float  # the file's frame rate
    total: int  # frames in the file
    indices: tuple[int, ...]  # which frames were sampled
    decoded: int = 0  # frames the decoder produced to reach them (the work it took)
    source: tuple[int, int] = (0, 0)  # the file's frame height, width (frames may be resized)

    @property
    def sampled_fps(self) -> float:
        """transformers' `VideoMetadata.sampled_fps`: sampled frames per second of video."""
        return len(self.indices) / self.total * self.fps


def sample_indices(total: int, fps: float, limits: VideoLimits, multiple: int) -> list[int]:
    """The frames `Qwen2VLVideoProcessor.sample_frames` picks from `total` frames at `fps`."""
    top = math.floor(min(limits.max_frames, total) / multiple) * multiple
    n = total / fps * limits.fps
    n = min(max(n, limits.min_frames), top, total)
    n = math.floor(n / multiple) * multiple
    if n < 1:
        raise VideoError(f"the video has {total} frames, fewer than the {multiple} it needs")
    return torch.arange(0, total, total / n).int().tolist()  # transformers' exact arithmetic


def sample_linspace(total: int, fps: float, limits: VideoLimits) -> list[int]:
    """The frames `Qwen3VLVideoProcessor.sample_frames` picks: `fps` a second (at least
    `min_frames`, at most `max_frames`), spread evenly from the first frame to the last."""
    n = int(total / fps * limits.fps)
    n = min(max(n, limits.min_frames), limits.max_frames, total)
    return np.linspace(0, total - 1, n).round().astype(int).tolist()


def decode_video(
    data: bytes,
    limits: VideoLimits = DEFAULT_LIMITS,
    multiple: int = 2,
    sampler=None,
    resize=None,
) -> Video:
    """The sampled frames of the video in `data` (`sampler(total, fps, limits)` picks them;
    default: `sample_indices`); `VideoError` when it is not one we take. `resize(n, h, w)`: the
    (height, width) the family's processor will resize n sampled h x w frames to; each frame is
    resized so as soon as it is decoded (the same arithmetic: `resize_frame`), so only frames
    of that size are kept."""
    try:
        import av
    except ImportError:
        raise VideoError("video input needs PyAV: pip install 'localllm[video]'") from None

    if not data:
        raise VideoError("the video is empty (0 bytes)")
    if len(data) > limits.max_bytes:
        raise VideoError(f"the video is {len(data)} bytes, more than {limits.max_bytes} allowed")
    try:
        container = av.open(io.BytesIO(data), "r")
    except (av.error.FFmpegError, ValueError, OSError) as e:
        raise VideoError(f"not a video in a format FFmpeg reads, or a corrupt one: {e}") from None
    with container:
        if not container.streams.video:
            raise VideoError("the file has no video stream")
        s = container.streams.video[0]
        fps = float(s.average_rate or s.guessed_rate or 0)
        w, h = s.codec_context.width, s.codec_context.height
        if fps <= 0 or w < 1 or h < 1:
            raise VideoError(f"the video stream has no usable frame rate or size ({w}x{h})")
        if w * h > limits.max_pixels:
            raise VideoError(f"the video's frames are {w}x{h}, above {limits.max_pixels} pixels")
        total = s.frames or 0
        seconds = total / fps if total else float(s.duration * s.time_base) if s.duration else 0
        if seconds > limits.max_seconds:
            raise VideoError(f"the video is {seconds:.0f} s long, above {limits.max_seconds:.0f} s")
        sampler = sampler or (lambda n, f, lim: sample_indices(n, f, lim, multiple))
        return _decode(container, s, limits, fps, multiple, total, sampler, (h, w), resize)


def _decode(container, s, limits, fps, multiple, total, sampler, source, resize) -> Video:
    import av

    try:
        if not total:  # a container without a frame count: count its packets, undecoded
            top = limits.max_seconds * fps
            for p in container.demux(s):
                total += bool(p.size)  # (the flush packet at the end is empty)
                if total > top:
                    raise VideoError(f"the video is longer than {limits.max_seconds:.0f} s")
            container.seek(0)
        want = sampler(total, fps, limits)
        size = tuple(resize(len(want), *source)) if resize else source
        need = len(want) * size[0] * size[1] * 3  # the kept frames, resized or not
        if need > limits.max_frames_bytes:
            need, top = need / 2**20, limits.max_frames_bytes / 2**20
            raise VideoError(
                f"the video's {len(want)} sampled frames take {need:.2f} MiB decoded, above "
                f"{top:.2f} MiB: send a shorter or smaller one"
            )
        out, decoded = _sampled(container, s, sorted(set(want)), fps, size)
    except av.error.FFmpegError as e:
        raise VideoError(f"corrupt video: {e}") from None
    if len(out) != len(set(want)):  # the header promised more frames than the stream holds
        want = [i for i in want if i in out]
        if not want:
            raise VideoError("the video has no decodable frames")
        want = want[: len(want) // multiple * multiple] or want
    return Video(np.stack([out[i] for i in want]), fps, total, tuple(want), decoded, source)


def resize_frame(rgb: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """One RGB frame [H, W, 3] uint8 resized to `size` (h, w) by torch's antialiased bicubic
    on uint8, as torchvision's video processors do on CPU (frame by frame, as they batch)."""
    if rgb.shape[:2] == tuple(size):
        return rgb
    x = torch.from_numpy(rgb).permute(2, 0, 1)[None]
    x = F.interpolate(x, size=list(size), mode="bicubic", align_corners=False, antialias=True)
    return x[0].permute(1, 2, 0).contiguous().numpy()


def _sampled(container, s, keep: list[int], fps: float, size) -> tuple[dict, int]:
    """The frames at indices `keep` (sorted) as RGB arrays of `size` (h, w), and how many
    frames were decoded.
    Frames are counted in decode order from the first (transformers' enumeration); after a seek
    the count restarts from the landing frame's timestamp (frame = time x fps)."""
    out: dict[int, np.ndarray] = {}
    frames, at, decoded = container.decode(s), -1, 0  # `at`: index of the last decoded frame
    start = s.start_time or 0
    for target in keep:
        if target - at > SEEK_GAP and s.time_base:  # far ahead: from the keyframe before it
            container.seek(start + int(target / fps / s.time_base), stream=s, backward=True)
            frames, at = container.decode(s), None
        for frame in frames:
            decoded += 1
            if at is None:  # the first frame after a seek: where it landed
                if frame.pts is None:
                    raise VideoError("the video's frames have no timestamps to seek by")
                at = round(float((frame.pts - start) * s.time_base) * fps)
            else:
                at += 1
            if at >= target:  # (past it only where the stream skips a frame: take the next)
                out[target] = resize_frame(frame.to_ndarray(format="rgb24"), size)
                break
        else:
            break  # the stream ended before this frame
    return out, decoded


def video_digest(v: Video, salt: str = "") -> str:
    h = hashlib.sha256()
    h.update(f"{salt}\x00video\x00{v.frames.shape}\x00{v.sampled_fps!r}\x00".encode())
    h.update(np.ascontiguousarray(v.frames).tobytes())
    return h.hexdigest()
