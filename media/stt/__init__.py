"""Speech to text (Whisper family): weights loaders, model, decoding."""

from localllm.media.stt.alignment import Word
from localllm.media.stt.bundle import WhisperBundle, load_whisper
from localllm.media.stt.decoding import DecodeOptions, DecodeResult, detect_language
from localllm.media.stt.formats import FORMATS, render
from localllm.media.stt.transcribe import Segment, Transcript, transcribe
from localllm.media.stt.weights import WhisperLoadError

__all__ = [
    "FORMATS",
    "DecodeOptions",
    "DecodeResult",
    "Segment",
    "Transcript",
    "WhisperBundle",
    "WhisperLoadError",
    "Word",
    "detect_language",
    "load_whisper",
    "render",
    "transcribe",
]
