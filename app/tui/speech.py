"""Speech for the TUI, run in worker threads: transcribe an attached audio file with Whisper,
and speak an answer with a Piper voice, played when `sounddevice` finds an output device, else
written as a wav file.

The models load on first use and stay loaded on the app's `SpeechModels` (one per app).
"""

from __future__ import annotations

import importlib.util
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch loads only when speech is first used
    from localllm.media.stt import WhisperBundle
    from localllm.media.tts import PiperVoice

# plays mono float32 samples at a rate; False when there is no way to play them
Player = Callable[[np.ndarray, int], bool]


class SpeechModels:
    """Whisper and the Piper voice, each loaded once, on first use, from any thread."""

    def __init__(self, whisper_model: Path | None = None, voice: Path | None = None) -> None:
        self.whisper_model, self.voice_path = whisper_model, voice
        self._lock = threading.Lock()
        self._bundle: WhisperBundle | None = None
        self._voice: PiperVoice | None = None

    def whisper(self) -> WhisperBundle:
        """The configured Whisper, else the packaged one; ValueError when there is none."""
        with self._lock:
            if self._bundle is None:
                from localllm.app.transcribe import pick_device, resolve_whisper
                from localllm.media.stt import load_whisper

                model = str(self.whisper_model) if self.whisper_model else None
                self._bundle = load_whisper(resolve_whisper(model), device=pick_device("auto"))
            return self._bundle

    def voice(self) -> PiperVoice:
        """The configured Piper voice, else the packaged one; FileNotFoundError when none."""
        with self._lock:
            if self._voice is None:
                from localllm.media.tts import load_voice

                self._voice = load_voice(self.voice_path)
            return self._voice


def transcribe_file(
    models: SpeechModels, path: Path, progress: Callable[[float], None] | None = None
) -> str:
    """The text spoken in `path`; `progress` gets the fraction done. Raises on a file that is
    not audio (checked before any model loads) and when no Whisper model is available."""
    from localllm.media.audio import audio_info, stream_audio
    from localllm.media.stt import DecodeOptions, transcribe

    info = audio_info(path)

    def report(done: float, total: float | None) -> None:
        if progress is not None and total:
            progress(min(done / total, 1.0))

    result = transcribe(
        models.whisper(), stream_audio(path), DecodeOptions(), report, info.duration
    )
    return result.text.strip()


_FENCE = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)
_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
_MARKS = re.compile(r"(^|\s)#{1,6}\s|[*_`>|~]|^\s*[-+]\s", re.M)


def speakable(markdown: str) -> str:
    """The prose of a Markdown answer: code blocks dropped, links reduced to their text, and
    emphasis, heading and list marks removed (a voice would read them out)."""
    text = _FENCE.sub(" ", markdown)
    text = _LINK.sub(r"\1", text)
    text = _MARKS.sub(r"\1", text)
    return re.sub(r"\s+", " ", text).strip()


def sounddevice_player(samples: np.ndarray, sample_rate: int) -> bool:
    """Play through `sounddevice` when it is installed and an output device works."""
    if importlib.util.find_spec("sounddevice") is None:
        return False
    try:
        import sounddevice

        sounddevice.play(samples, sample_rate)
        sounddevice.wait()
    except Exception:  # PortAudio missing, no output device, device busy
        return False
    return True


@dataclass(frozen=True)
class Spoken:
    """What speaking did: played, or saved to `path`; the audio's length in seconds."""

    played: bool
    path: Path | None
    seconds: float


SPEAK_SEED = 0  # VITS samples noise: a fixed seed says the same answer the same way every time


def speak(models: SpeechModels, text: str, out_path: Path, player: Player) -> Spoken:
    """Synthesize `text`, play it, and when it cannot be played, write it to `out_path` (wav)."""
    from localllm.media.audio.encode import encode

    voice = models.voice()
    samples = voice.synthesize(text, seed=SPEAK_SEED)
    if samples.size == 0:
        raise ValueError("the answer has nothing to say aloud")
    seconds = len(samples) / voice.sample_rate
    if player(samples, voice.sample_rate):
        return Spoken(True, None, seconds)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_bytes(encode(samples, voice.sample_rate, "wav"))
    return Spoken(False, out_path, seconds)
