"""Audio I/O: decoding, resampling, log-mel features, chunking, encoding."""

from localllm.media.audio.chunk import SeekBuffer, Span, chunk_spans
from localllm.media.audio.decode import (
    SAMPLE_RATE,
    AudioError,
    AudioInfo,
    audio_info,
    load_audio,
    stream_audio,
)
from localllm.media.audio.mel import MelSpec, log_mel, mel_filters

__all__ = [
    "SAMPLE_RATE",
    "AudioError",
    "AudioInfo",
    "MelSpec",
    "SeekBuffer",
    "Span",
    "audio_info",
    "chunk_spans",
    "load_audio",
    "log_mel",
    "mel_filters",
    "stream_audio",
]
