"""Music longer than a model's position table (40.9 s for musicgen-small), the way audiocraft's
`MusicGen._generate_tokens` makes it: windows of at most `window` seconds (audiocraft's
`max_duration`, 30 s: the length MusicGen was trained on), each after the first prompted with
the last `window - stride` seconds of codes made so far (audiocraft's `extend_stride`, 18 s: a
window adds 18 s and re-reads the previous 12 s). A melody model reads the melody from the
window's time on, looped past its end, as audiocraft does. Window i samples with seed + i.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from localllm.media.music.sampling import SamplingOptions

WINDOW_SECONDS = 30.0  # audiocraft's max_duration for MusicGen
EXTEND_STRIDE = 18.0  # audiocraft's default extend_stride
Progress = Callable[[float, float], None]


def default_window(limit: float) -> tuple[float, float]:
    """(window, stride) seconds for a model that holds `limit` seconds: audiocraft's 30 s and
    18 s, scaled down together for a model that holds less than 30 s."""
    window = min(WINDOW_SECONDS, limit)
    return window, EXTEND_STRIDE * window / WINDOW_SECONDS


def melody_window(melody: np.ndarray, start: int, length: int) -> np.ndarray:
    """`length` samples of `melody` from sample `start`, looped past its end."""
    return melody[..., (start + np.arange(length)) % melody.shape[-1]]


def extended_codes(
    codes_fn: Callable[..., torch.Tensor],
    frames: int,
    frame_rate: int,
    sample_rate: int,
    opts: SamplingOptions,
    window: float,
    stride: float,
    melody: np.ndarray | None = None,
    prompt_codes: torch.Tensor | None = None,
    progress: Progress | None = None,
) -> torch.Tensor:
    """(K, frames) codes made window by window with `codes_fn(frames, opts, melody,
    prompt_codes, progress)` (one window, `frames` counting its prompt)."""
    win, step = int(window * frame_rate), int(stride * frame_rate)
    if not 0 < step < win:
        raise ValueError(f"extend stride must be in (0, window={window:g}) s, got {stride:g}")
    pieces, prompt, offset, made = [], None, 0, 0
    if prompt_codes is not None and prompt_codes.shape[1]:
        # the clip stays whole in the output; a window re-reads at most its last win - step
        pieces, made = [prompt_codes], prompt_codes.shape[1]
        prompt = prompt_codes[:, -(win - step) :]
        offset = made - prompt.shape[1]
    index = 0
    while offset + (0 if prompt is None else prompt.shape[1]) < frames:
        length = min(frames - offset, win)
        used = 0 if prompt is None else prompt.shape[1]
        mel = None
        if melody is not None:
            per_frame = sample_rate // frame_rate
            mel = melody_window(melody, offset * per_frame, length * per_frame)
        seed = None if opts.seed is None else opts.seed + index
        report = _window_progress(progress, made, length - used, frames, frame_rate)
        got = codes_fn(length, replace(opts, seed=seed), mel, prompt, report)
        pieces.append(got[:, used:])
        made += length - used
        prompt = got[:, step:]
        offset += step
        index += 1
    return torch.cat(pieces, dim=1)[:, :frames]


def _window_progress(progress, made: int, new: int, frames: int, rate: int):
    if progress is None:
        return None

    def report(done: float, total: float) -> None:
        progress((made + new * done / total) / rate, frames / rate)

    return report
