"""The recorded MusicGen fixtures (`tests/tools/record_music_fixtures.py`): tiny random-weight
folders made with transformers and transformers' own results on them."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[2] / "data" / "music"
MELODY_WAV = DATA / "melody.wav"
CLIP_WAV = DATA / "clip.wav"


@cache
def expected() -> dict:
    return json.loads((DATA / "expected.json").read_text())


@cache
def expected_audio() -> dict[str, np.ndarray]:
    with np.load(DATA / "expected_audio.npz") as f:
        return {k: f[k] for k in f.files}


@cache
def model(name: str):
    from localllm.media.music import MusicGen

    return MusicGen(DATA / name)
