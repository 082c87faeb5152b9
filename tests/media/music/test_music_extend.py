"""Music past the position table, windowed like audiocraft's `MusicGen._generate_tokens`
(max_duration windows, each re-prompted with the codes after `extend_stride`): the windows'
codes are what one-window calls give with audiocraft's prompts and offsets, a duration past the
table (an error before) makes music of that length, the clip being continued stays whole, a
melody is read from each window's time on, looped; the 300 s request limit stays."""

import numpy as np
import pytest
import torch

from localllm.media.music import SamplingOptions, check_seconds
from localllm.media.music.extend import EXTEND_STRIDE, WINDOW_SECONDS, default_window, melody_window
from tests.media.music.music_fixture import model

PROMPT = "calm piano"


def _audiocraft_windows(m, seconds, window, stride, opts, prompt_codes=None):
    """audiocraft's loop (genmodel.py `_generate_tokens`), written out over one-window calls."""
    rate = m.config.frame_rate
    total, win, step = round(seconds * rate), int(window * rate), int(stride * rate)
    out, prompt, offset, i = [], prompt_codes, 0, 0
    if prompt_codes is not None:
        out.append(prompt_codes)
    while offset + (0 if prompt is None else prompt.shape[1]) < total:
        n = min(total - offset, win)
        seed_opts = SamplingOptions(**{**opts.__dict__, "seed": opts.seed + i})
        got = m.codes(PROMPT, n, seed_opts, None, prompt)
        out.append(got if prompt is None else got[:, prompt.shape[1] :])
        prompt, offset, i = got[:, step:], offset + step, i + 1
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_windows_are_audiocrafts(temperature):
    m = model("musicgen")
    opts = SamplingOptions(temperature=temperature, top_k=50, seed=3)
    music = m.generate(PROMPT, 4.4, opts, window=2.0, stride=1.2)
    want = _audiocraft_windows(m, 4.4, 2.0, 1.2, opts)
    assert music.codes.shape == (4, 220) and torch.equal(music.codes, want)
    assert music.seconds == pytest.approx(4.4)


def test_past_the_position_table_makes_the_whole_duration():
    m = model("musicgen-stereo")
    limit = m.max_seconds(len(m.tokenizer.encode(PROMPT).ids))
    assert limit < 8  # the tiny model holds ~5 s: 8 s needs windows
    seen = []
    music = m.generate(PROMPT, 8.0, SamplingOptions(seed=1), progress=lambda d, t: seen.append(d))
    assert music.samples.shape == (2, 8 * m.sample_rate) and music.codes.shape == (8, 400)
    assert seen == sorted(seen) and seen[-1] == pytest.approx(8.0)
    window, stride = default_window(limit)
    assert window == pytest.approx(limit) and stride == pytest.approx(0.6 * limit)
    again = m.generate(PROMPT, 8.0, SamplingOptions(seed=1))
    assert torch.equal(music.codes, again.codes)  # seeded windows: reproducible


def test_continued_clip_stays_whole_and_windows_go_on_from_it():
    m = model("musicgen")
    opts = SamplingOptions(temperature=0.0)
    clip = m.decode(m.codes(PROMPT, 90, opts))  # 1.8 s: longer than window - stride (0.8 s)
    music = m.generate(PROMPT, 4.0, opts, continuation=clip, window=2.0, stride=1.2)
    clip_codes = m.encode(clip)
    assert torch.equal(music.codes[:, :90], clip_codes) and music.codes.shape[1] == 200
    # the first window re-reads the clip's last 0.8 s (40 frames), from frame 50 on
    first = m.codes(PROMPT, 100, SamplingOptions(temperature=0.0, seed=0), None,
                    clip_codes[:, -40:])  # fmt: skip
    assert torch.equal(music.codes[:, 90:150], first[:, 40:])


def test_melody_windows_read_the_melody_from_their_time_looped():
    mel = np.arange(10.0)
    assert melody_window(mel, 7, 6).tolist() == [7, 8, 9, 0, 1, 2]
    m = model("musicgen-melody")
    melody = np.sin(np.arange(m.sample_rate * 2) / 40.0).astype(np.float32)
    music = m.generate(PROMPT, 7.0, SamplingOptions(seed=2), melody=melody)
    assert music.codes.shape == (4, 350)


def test_limits_stay():
    assert (WINDOW_SECONDS, EXTEND_STRIDE) == (30.0, 18.0)  # audiocraft's defaults
    with pytest.raises(ValueError, match="<= 300 seconds"):
        check_seconds(600)
    with pytest.raises(ValueError, match="extend stride must be in"):
        model("musicgen").generate(PROMPT, 3.0, SamplingOptions(seed=0), window=2.0, stride=2.0)
    with pytest.raises(ValueError, match="window 9 s is longer than"):
        model("musicgen").generate(PROMPT, 12.0, SamplingOptions(seed=0), window=9.0)
