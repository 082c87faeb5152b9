"""A Kokoro model directory (config.json + a .pth checkpoint or the int8 .onnx export + voices:
voices/*.pt, or .npz archives of them) and its voices, with Piper's synthesis interface:
`sentences`, `render`, `stream`, `synthesize`.

A voice file is a style table [510, 1, 256]: row `n - 1` is the style for an n-phoneme input.
`KokoroTTS` holds the one model; `KokoroVoice` pairs it with a voice table, so one loaded model
serves every voice. `stream` phonemizes the whole text first (cheap) and yields audio sentence
by sentence, so the first audio is ready after one sentence.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from localllm.media.tts.kokoro.checkpoint import load_model
from localllm.media.tts.kokoro.config import STYLE_SPLIT, KokoroConfig, KokoroFormatError
from localllm.media.tts.kokoro.istftnet import SAMPLE_RATE
from localllm.media.tts.kokoro.model import KokoroModel
from localllm.media.tts.kokoro.phonemes import espeak_voice, kokoro_sentences
from localllm.media.tts.phonemize import Sentence
from localllm.media.tts.piper import AudioChunk, check_speed

DEFAULT_VOICE = "af_heart"
CHECKPOINT_NAME = "kokoro-v1_0.pth"


_NPZ = (".npz", ".bin")  # kokoro-onnx ships its voices as an .npz named voices-v1.0.bin


def _weights(path: Path) -> list[Path]:
    return sorted(path.glob("*.pth")) or sorted(path.glob("*.onnx"))


def is_kokoro_dir(path: str | Path) -> bool:
    """A directory holding config.json and a .pth checkpoint (or the .onnx export)."""
    path = Path(path)
    return path.is_dir() and (path / "config.json").is_file() and bool(_weights(path))


def _voice_files(path: Path) -> dict[str, Path]:
    """Voice name -> file: voices/*.pt, and every array of .npz archives in the directory."""
    voices = {v.stem: v for v in sorted((path / "voices").glob("*.pt"))}
    for archive in sorted(p for p in path.iterdir() if p.suffix in _NPZ):
        try:
            with np.load(archive) as data:
                voices.update({name: archive for name in data.files})
        except (OSError, ValueError) as exc:
            raise KokoroFormatError(f"{archive}: not a voice archive ({exc})") from exc
    return voices


def read_voice(path: str | Path, name: str | None = None) -> torch.Tensor:
    """A voice file (or voice `name` in an .npz archive) -> its style table [N, 256]."""
    try:
        if Path(path).suffix in _NPZ:
            with np.load(path) as data:
                table = torch.from_numpy(np.array(data[name or Path(path).stem]))
        else:
            table = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch and numpy raise many types for a bad file
        raise KokoroFormatError(f"{path}: not a voice file ({exc})") from exc
    if not isinstance(table, torch.Tensor) or table.shape[-1] != 2 * STYLE_SPLIT:
        raise KokoroFormatError(f"{path}: a voice is a [N, 1, 256] tensor")
    return table.reshape(-1, 2 * STYLE_SPLIT).float()


class KokoroVoice:
    """One voice of a loaded Kokoro model. Thread-safe: synthesis keeps no per-call state."""

    def __init__(
        self, model: KokoroModel, table: torch.Tensor, name: str, language: str | None = None
    ) -> None:
        self.model = model
        self.table = table
        self.name = name
        self.language = language or espeak_voice(name)
        # two boundary tokens; and the style table has one row per phoneme count
        self.max_phonemes = min(model.config.context_length - 2, table.shape[0])

    @property
    def sample_rate(self) -> int:
        return SAMPLE_RATE

    def sentences(self, text: str) -> list[Sentence]:
        """The text's synthesis units in Kokoro symbols (cheap: phonemization only)."""
        cfg = self.model.config
        return kokoro_sentences(text, self.language, cfg.vocab, self.max_phonemes)

    def token_ids(self, sentence: Sentence) -> torch.Tensor:
        """[1, T + 2]: 0, the symbols' ids, 0."""
        vocab = self.model.config.vocab
        ids = [vocab[p] for p in sentence.phonemes if p in vocab]
        return torch.tensor([[0, *ids, 0]], dtype=torch.long)

    def style(self, sentence: Sentence) -> torch.Tensor:
        n = min(max(len(sentence.phonemes), 1), self.table.shape[0])
        return self.table[n - 1 : n]

    def render(
        self, sentence: Sentence, speed: float = 1.0, generator: torch.Generator | None = None
    ) -> AudioChunk:
        """Synthesize one sentence."""
        check_speed(speed)
        if len(sentence.phonemes) > self.max_phonemes:
            raise ValueError(f"a sentence holds at most {self.max_phonemes} phonemes")
        audio, _ = self.model(self.token_ids(sentence), self.style(sentence), speed, generator)
        samples = audio.clamp(-1.0, 1.0).numpy().astype(np.float32, copy=False)
        return AudioChunk(samples, SAMPLE_RATE, sentence.text)

    def stream(
        self, text: str, speed: float = 1.0, seed: int | None = None
    ) -> Iterator[AudioChunk]:
        """Yield one AudioChunk per sentence as soon as it is synthesized."""
        check_speed(speed)  # a bad speed fails before any work
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        for sentence in self.sentences(text):
            yield self.render(sentence, speed, generator)

    def synthesize(self, text: str, speed: float = 1.0, seed: int | None = None) -> np.ndarray:
        """The whole text as one float32 array (empty if the text has nothing to say)."""
        parts = [c.samples for c in self.stream(text, speed, seed)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


class KokoroTTS:
    """A loaded Kokoro model and the voice files next to it."""

    def __init__(self, model: KokoroModel, voices: dict[str, Path], name: str) -> None:
        self.model = model
        self.voice_files = voices
        self.name = name

    @classmethod
    def load(cls, path: str | Path) -> KokoroTTS:
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"no Kokoro model directory {path}")
        config = KokoroConfig.from_json(path / "config.json")
        checkpoints = _weights(path)
        if not checkpoints:
            raise FileNotFoundError(f"no .pth checkpoint (or .onnx export) in {path}")
        preferred = [c for c in checkpoints if c.name == CHECKPOINT_NAME]
        if not preferred and len(checkpoints) > 1:
            names = ", ".join(c.name for c in checkpoints)
            raise KokoroFormatError(f"{path}: several checkpoints ({names}); keep one")
        voices = _voice_files(path)
        if not voices:
            raise FileNotFoundError(f"no voices in {path} (expected voices/*.pt or an .npz)")
        return cls(load_model(config, (preferred or checkpoints)[0]), voices, path.name)

    @property
    def sample_rate(self) -> int:
        return SAMPLE_RATE

    @property
    def default_voice(self) -> str:
        return DEFAULT_VOICE if DEFAULT_VOICE in self.voice_files else next(iter(self.voice_files))

    def voice(self, name: str | None = None, language: str | None = None) -> KokoroVoice:
        """Load a voice by file name (without .pt); None = af_heart, else the first voice.

        `language` (an espeak voice, e.g. "en-us") overrides the one the name's first letter
        implies, to read text in another language with this voice's timbre."""
        name = name or self.default_voice
        if name not in self.voice_files:
            known = ", ".join(self.voice_files)
            raise ValueError(f"unknown voice {name!r}; this model has: {known}")
        table = read_voice(self.voice_files[name], name)
        return KokoroVoice(self.model, table, name, language)


def load_kokoro(path: str | Path) -> KokoroTTS:
    """Load a Kokoro model directory (config.json, kokoro-v1_0.pth, voices/*.pt)."""
    return KokoroTTS.load(path)
