"""Text-to-music: MusicGen and MusicGen-Melody from Hugging Face safetensors folders (T5 text
encoder, codebook LM with the delay pattern and classifier-free guidance, EnCodec)."""

from localllm.media.music.config import MusicGenConfig, MusicModelError, load_config
from localllm.media.music.generate import MAX_SECONDS, Music, MusicGen, check_seconds
from localllm.media.music.sampling import SamplingOptions

__all__ = [
    "MAX_SECONDS",
    "Music",
    "MusicGen",
    "MusicGenConfig",
    "MusicModelError",
    "SamplingOptions",
    "check_seconds",
    "load_config",
]
