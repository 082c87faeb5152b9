"""Kokoro-82M text to speech in torch: PL-BERT + StyleTTS2 prosody + iSTFTNet, loaded from a
Kokoro directory (config.json, kokoro-v1_0.pth, voices/*.pt), espeak-ng phonemes mapped to
Kokoro's symbols, streaming synthesis sentence by sentence."""

from localllm.media.tts.kokoro.config import KokoroConfig, KokoroFormatError
from localllm.media.tts.kokoro.model import KokoroModel, Prosody
from localllm.media.tts.kokoro.voices import (
    KokoroTTS,
    KokoroVoice,
    is_kokoro_dir,
    load_kokoro,
    read_voice,
)

__all__ = [
    "KokoroConfig",
    "KokoroFormatError",
    "KokoroModel",
    "KokoroTTS",
    "KokoroVoice",
    "Prosody",
    "is_kokoro_dir",
    "load_kokoro",
    "read_voice",
]
