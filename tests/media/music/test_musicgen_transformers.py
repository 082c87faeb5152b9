"""Our MusicGen against transformers on the same tiny random-weight folders: the greedy codes
(CFG 3 and CFG off, stereo, a melody file, no melody, a continued clip) and seeded sampled codes
are equal, on the cached fast path, the CUDA graph's static step run eagerly and the plain
reference, and the decoded waveforms agree
within 1e-5 of the waveform's peak (float32; the largest seen is 1.5e-6)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from localllm.media.audio import load_audio
from localllm.media.music import SamplingOptions
from localllm.media.music.chroma import chroma
from localllm.media.music.clip import load_clip
from tests.media.music.music_fixture import CLIP_WAV, MELODY_WAV, expected, expected_audio, model

CASES = sorted(expected()["cases"])
WAVE_RTOL = 1e-5  # of the peak: float32 convolutions summed in another order


def _inputs(name: str, case: dict):
    m = model(case["model"])
    sampled = "seed" in case
    opts = SamplingOptions(
        temperature=case["temperature"] if sampled else 0.0,
        top_k=case.get("top_k", 0),
        top_p=case.get("top_p", 1.0),
        guidance_scale=case["guidance_scale"],
        seed=case.get("seed"),
    )
    melody = load_audio(MELODY_WAV, m.sample_rate) if name.startswith("melody_cfg") else None
    frames, prompt_codes = expected()["frames"], None
    if "prompt_frames" in case:
        prompt_codes = m.encode(load_clip(CLIP_WAV, m.sample_rate, m.channels))
        frames += case["prompt_frames"]
    return m, opts, melody, frames, prompt_codes


def test_tokenizer_matches_transformers():
    assert model("musicgen").tokenize(expected()["prompt"])[0].tolist() == expected()["ids"]


@pytest.mark.parametrize("steps", ["cached", "static", "reference"])
@pytest.mark.parametrize("name", CASES)
def test_codes_equal_transformers(name, steps):
    """`static` is the CUDA graph's step (fixed inputs, cache written at a position tensor,
    attention over the whole cache under a mask) run eagerly on the CPU."""
    case = expected()["cases"][name]
    m, opts, melody, frames, prompt_codes = _inputs(name, case)
    ref = steps == "reference"
    codes = m.codes(expected()["prompt"], frames, opts, melody, prompt_codes, cached=not ref,
                    steps=None if ref else steps)  # fmt: skip
    assert codes.tolist() == case["codes"]


@pytest.mark.parametrize("name", sorted(expected_audio()))
def test_waveform_matches_transformers(name):
    case = expected()["cases"][name]
    m = model(case["model"])
    ours = m.decode(torch.tensor(case["codes"]))
    theirs = expected_audio()[name]
    assert ours.shape == theirs.shape
    peak = np.abs(theirs).max()
    assert peak > 1  # random weights: loud, not silent
    assert np.abs(ours - theirs).max() <= WAVE_RTOL * peak


def test_clip_codes_match_transformers_encoder():
    m = model("musicgen")
    codes = m.encode(load_clip(CLIP_WAV, m.sample_rate, 1))
    assert codes.tolist() == expected()["clip_codes"]


def test_chroma_matches_transformers_feature_extractor():
    m = model("musicgen-melody")
    feats = chroma(load_audio(MELODY_WAV, m.sample_rate), m.config.chroma)
    assert feats.argmax(-1).tolist() == expected()["chroma"]
    assert feats.sum(-1).eq(1).all()  # one-hot per frame


def test_generate_end_to_end_equals_codes_then_decode():
    """`generate` (duration in seconds, the clip file) gives the recorded continuation."""
    case = expected()["cases"]["continue_cfg3"]
    m = model("musicgen")
    clip = load_clip(CLIP_WAV, m.sample_rate, 1)
    seconds = (expected()["frames"] + case["prompt_frames"]) / m.config.frame_rate
    music = m.generate(
        expected()["prompt"], seconds, SamplingOptions(temperature=0), continuation=clip
    )
    assert music.codes.tolist() == case["codes"]
    assert music.samples.shape == (1, len(case["codes"][0]) * 640)
    assert music.sample_rate == 32000
