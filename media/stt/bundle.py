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
from localllm.media.stt.weights import WhisperLoadError, ggml_file, load_model


@dataclass(frozen=True)
class WhisperBundle:
    """Everything decoding needs from one checkpoint."""

    name: str
    model: Whisper
    tokenizer: WhisperTokenizer
    mel: MelSpec
    filters: torch.Tensor  # [n_mels, n_fft // 2 + 1]
    suppress: tuple[int, ...]  # non-speech tokens, never sampled
    # (decoder layer, head) pairs whose cross-attention tracks the speech; () when unknown
    alignment_heads: tuple[tuple[int, int], ...] = ()

    @property
    def multilingual(self) -> bool:
        return self.model.config.multilingual


def _suppress_list(path: Path, tokenizer: WhisperTokenizer) -> tuple[int, ...]:
    sources = (("config.json", "suppress_ids"), ("generation_config.json", "suppress_tokens"))
    folder = path if path.is_dir() else path.parent
    for name, key in sources:
        file = folder / name
        if file.is_file():
            ids = json.loads(file.read_text()).get(key)
            if isinstance(ids, list) and ids:
                return tuple(sorted({int(i) for i in ids if int(i) >= 0}))
    return tuple(tokenizer.non_speech_tokens())


# openai-whisper's published alignment heads for checkpoints that may come without a config
# (ggml files), keyed by (decoder layers, width, multilingual); the same lists the packaged
# CTranslate2 configs carry.
_KNOWN_HEADS: dict[tuple[int, int, bool], tuple[tuple[int, int], ...]] = {
    (4, 384, False): ((1, 0), (2, 0), (2, 5), (3, 0), (3, 1), (3, 2), (3, 3), (3, 4)),  # tiny.en
    (6, 512, True): ((3, 1), (4, 2), (4, 3), (4, 7), (5, 1), (5, 2), (5, 4), (5, 6)),  # base
}


def _alignment_heads(path: Path, model: Whisper) -> tuple[tuple[int, int], ...]:
    """From config.json (CTranslate2) or generation_config.json (HF), else the known defaults."""
    folder = path if path.is_dir() else path.parent
    cfg = model.config
    for name in ("config.json", "generation_config.json"):
        file = folder / name
        if not file.is_file():
            continue
        heads = json.loads(file.read_text()).get("alignment_heads")
        if isinstance(heads, list) and heads:
            pairs = tuple((int(layer), int(head)) for layer, head in heads)
            if all(0 <= la < cfg.n_text_layer and 0 <= h < cfg.n_text_head for la, h in pairs):
                return pairs
    return _KNOWN_HEADS.get((cfg.n_text_layer, cfg.n_text_state, cfg.multilingual), ())


def _ggml_tokenizer(path: Path, n_vocab: int) -> WhisperTokenizer:
    """A ggml file holds only token bytes: use a tokenizer.json beside it, else the packaged
    Whisper's (all but large-v3 share one of two vocabularies), checked against the bytes."""
    from localllm.media.stt.ggml import read_ggml
    from localllm.media.stt.packaged import base_parts, tiny_en_dir

    candidates = [path.parent / "tokenizer.json"]
    if n_vocab == 51864 and tiny_en_dir() is not None:
        candidates.append(tiny_en_dir() / "tokenizer.json")  # English-only vocabulary
    if n_vocab == 51865 and base_parts() is not None:
        candidates.append(base_parts()[0] / "tokenizer.json")  # multilingual vocabulary
    file = next((c for c in candidates if c.is_file()), None)
    if file is None:
        raise WhisperLoadError(f"{path}: no tokenizer.json beside it for this vocabulary")
    tokenizer = WhisperTokenizer.from_file(file)
    vocab = read_ggml(path, with_tensors=False).vocab
    for i in range(0, min(len(vocab), 5000), 7):  # ASCII tokens decode the same in both
        if vocab[i].isascii() and tokenizer.tok.decode([i]) != vocab[i].decode():
            raise WhisperLoadError(f"{path}: {file} does not match the file's vocabulary")
    return tokenizer


def load_whisper(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> WhisperBundle:
    """Load the Whisper checkpoint at `path`: a CTranslate2 or HF safetensors directory, or a
    whisper.cpp ggml file."""
    path = Path(path)
    model = load_model(path, device=device, dtype=dtype)
    ggml = ggml_file(path)
    tok_file = path / "tokenizer.json"
    if ggml is not None and not tok_file.is_file():
        tokenizer = _ggml_tokenizer(ggml, model.config.n_vocab)
    elif tok_file.is_file():
        tokenizer = WhisperTokenizer.from_file(tok_file)
    else:
        raise WhisperLoadError(f"{path}: no tokenizer.json beside the weights")
    if tokenizer.special.timestamp_begin + 1501 > model.config.n_vocab:
        raise WhisperLoadError(f"{path}: tokenizer and model vocabularies disagree")
    spec = MelSpec(n_mels=model.config.n_mels)
    filters = torch.from_numpy(mel_filters(spec))
    suppress = _suppress_list(path, tokenizer)
    name = path.stem if path.is_file() else path.name
    heads = _alignment_heads(path, model)
    return WhisperBundle(name, model, tokenizer, spec, filters, suppress, heads)
