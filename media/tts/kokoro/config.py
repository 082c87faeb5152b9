"""Kokoro's config.json: the phoneme vocabulary and the network sizes, read into frozen
dataclasses with clear errors for a file that is not a Kokoro config."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localllm.media.tts.kokoro.albert import AlbertConfig
from localllm.media.tts.kokoro.istftnet import IstftConfig

STYLE_SPLIT = 128  # a voice vector is [decoder style (128) | prosody style (128)]


class KokoroFormatError(ValueError):
    """A Kokoro model directory, config, checkpoint or voice file is missing or malformed."""


@dataclass(frozen=True)
class KokoroConfig:
    vocab: dict[str, int]
    n_token: int
    hidden_dim: int
    style_dim: int
    n_layer: int
    max_dur: int
    text_encoder_kernel_size: int
    plbert: AlbertConfig
    istftnet: IstftConfig

    @property
    def context_length(self) -> int:
        return self.plbert.max_position_embeddings

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KokoroConfig:
        try:
            vocab = {str(k): int(v) for k, v in data["vocab"].items()}
            plbert = dict(data["plbert"])
            plbert.pop("dropout", None)
            known = AlbertConfig.__dataclass_fields__
            plbert_cfg = AlbertConfig(
                vocab_size=int(data["n_token"]),
                **{k: v for k, v in plbert.items() if k in known and k != "vocab_size"},
            )
            ist = data["istftnet"]
            istft_cfg = IstftConfig(
                upsample_rates=tuple(int(v) for v in ist["upsample_rates"]),
                upsample_kernel_sizes=tuple(int(v) for v in ist["upsample_kernel_sizes"]),
                upsample_initial_channel=int(ist["upsample_initial_channel"]),
                resblock_kernel_sizes=tuple(int(v) for v in ist["resblock_kernel_sizes"]),
                resblock_dilation_sizes=tuple(
                    tuple(int(d) for d in ds) for ds in ist["resblock_dilation_sizes"]
                ),
                gen_istft_n_fft=int(ist["gen_istft_n_fft"]),
                gen_istft_hop_size=int(ist["gen_istft_hop_size"]),
            )
            cfg = cls(
                vocab=vocab,
                n_token=int(data["n_token"]),
                hidden_dim=int(data["hidden_dim"]),
                style_dim=int(data["style_dim"]),
                n_layer=int(data["n_layer"]),
                max_dur=int(data["max_dur"]),
                text_encoder_kernel_size=int(data["text_encoder_kernel_size"]),
                plbert=plbert_cfg,
                istftnet=istft_cfg,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise KokoroFormatError(f"not a Kokoro config ({type(exc).__name__}: {exc})") from exc
        if len(istft_cfg.upsample_rates) != len(istft_cfg.upsample_kernel_sizes) or len(
            istft_cfg.resblock_kernel_sizes
        ) != len(istft_cfg.resblock_dilation_sizes):
            raise KokoroFormatError("istftnet: upsample or resblock lists differ in length")
        if cfg.style_dim != STYLE_SPLIT or max(vocab.values(), default=0) >= cfg.n_token:
            raise KokoroFormatError(
                f"unsupported Kokoro config: style_dim {cfg.style_dim} (need {STYLE_SPLIT}), "
                f"vocab ids up to {max(vocab.values(), default=0)} for n_token {cfg.n_token}"
            )
        return cfg

    @classmethod
    def from_json(cls, path: str | Path) -> KokoroConfig:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise KokoroFormatError(f"{path}: cannot read Kokoro config ({exc})") from exc
        if not isinstance(data, dict):
            raise KokoroFormatError(f"{path}: not a Kokoro config (not a JSON object)")
        try:
            return cls.from_dict(data)
        except KokoroFormatError as exc:
            raise KokoroFormatError(f"{path}: {exc}") from exc
