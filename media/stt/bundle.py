"""A loaded Whisper checkpoint: model, tokenizer, front-end constants and suppression lists.

`load_whisper(dir)` reads any directory `weights.load_model` understands, plus its
`tokenizer.json` and whatever suppression lists its config carries.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from localllm.media.audio.mel import MelSpec, mel_filters
from localllm.media.stt.model import Whisper
from localllm.media.stt.tokenizer import WhisperTokenizer
from localllm.media.stt.weights import WhisperLoadError, load_model


@dataclass(frozen=True)
class WhisperBundle:
    """Everything decoding needs from one checkpoint."""

    name: str
    model: Whisper
    tokenizer: WhisperTokenizer
    mel: MelSpec
    filters: torch.Tensor  # [n_mels, n_fft // 2 + 1]
    suppress: tuple[int, ...]  # non-speech tokens, never sampled

    @property
    def multilingual(self) -> bool:
        return self.model.config.multilingual


def _suppress_list(path: Path, tokenizer: WhisperTokenizer) -> tuple[int, ...]:
    sources = (("config.json", "suppress_ids"), ("generation_config.json", "suppress_tokens"))
    for name, key in sources:
        file = path / name
        if file.is_file():
            ids = json.loads(file.read_text()).get(key)
            if isinstance(ids, list) and ids:
                return tuple(sorted({int(i) for i in ids if int(i) >= 0}))
    return tuple(tokenizer.non_speech_tokens())


def load_whisper(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> WhisperBundle:
    """Load the Whisper checkpoint directory `path` (CTranslate2 or HF safetensors)."""
    path = Path(path)
    model = load_model(path, device=device, dtype=dtype)
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise WhisperLoadError(f"{path}: no tokenizer.json beside the weights")
    tokenizer = WhisperTokenizer.from_file(tok_file)
    if tokenizer.special.timestamp_begin + 1501 > model.config.n_vocab:
        raise WhisperLoadError(f"{path}: tokenizer and model vocabularies disagree")
    spec = MelSpec(n_mels=model.config.n_mels)
    filters = torch.from_numpy(mel_filters(spec))
    suppress = _suppress_list(path, tokenizer)
    return WhisperBundle(path.name, model, tokenizer, spec, filters, suppress)
