"""Text to speech: Piper (VITS) voices in torch, espeak-ng phonemization, streaming synthesis."""

from localllm.media.tts.onnx_weights import VoiceFormatError
from localllm.media.tts.phonemize import PhonemizerError, Sentence, phonemize
from localllm.media.tts.piper import AudioChunk, PiperVoice, default_voice_path, load_voice

__all__ = [
    "AudioChunk",
    "PhonemizerError",
    "PiperVoice",
    "Sentence",
    "VoiceFormatError",
    "default_voice_path",
    "load_voice",
    "phonemize",
]
