"""The Kokoro-82M graph: PL-BERT -> bert_encoder -> prosody (durations, F0, energy) ->
alignment -> TextEncoder -> iSTFTNet decoder -> 24 kHz audio.

Submodule names are the checkpoint's top-level keys (`bert`, `bert_encoder`, `predictor`,
`text_encoder`, `decoder`). `prosody` and `decode` are the two halves of `forward`, exposed so
tests can compare each stage with the reference implementation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from localllm.media.tts.kokoro.albert import Albert
from localllm.media.tts.kokoro.config import STYLE_SPLIT, KokoroConfig
from localllm.media.tts.kokoro.istftnet import Decoder
from localllm.media.tts.kokoro.prosody import ProsodyPredictor, TextEncoder, alignment


@dataclass(frozen=True)
class Prosody:
    """What the predictor decided for one sequence: frames per token [T] (ints >= 1), the
    F0 and energy curves [1, 2F], and the aligned text features for the decoder [1, C, F]."""

    durations: torch.Tensor
    f0: torch.Tensor
    n: torch.Tensor
    asr: torch.Tensor


class KokoroModel(nn.Module):
    """Token ids (with the 0 boundary tokens) + a voice vector -> waveform. Batch size 1."""

    def __init__(self, cfg: KokoroConfig) -> None:
        super().__init__()
        self.config = cfg
        self.bert = Albert(cfg.plbert)
        self.bert_encoder = nn.Linear(cfg.plbert.hidden_size, cfg.hidden_dim)
        self.predictor = ProsodyPredictor(cfg.style_dim, cfg.hidden_dim, cfg.n_layer, cfg.max_dur)
        self.text_encoder = TextEncoder(
            cfg.hidden_dim, cfg.text_encoder_kernel_size, cfg.n_layer, cfg.n_token
        )
        self.decoder = Decoder(cfg.hidden_dim, cfg.style_dim, cfg.istftnet)

    def _check(self, ids: torch.Tensor, ref_s: torch.Tensor) -> None:
        if ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] < 1:
            raise ValueError(f"token ids must have shape [1, T], got {tuple(ids.shape)}")
        if ids.shape[1] > self.config.context_length:
            raise ValueError(
                f"{ids.shape[1]} tokens exceed the context of {self.config.context_length}"
            )
        if ref_s.shape != (1, 2 * STYLE_SPLIT):
            raise ValueError(f"voice vector must have shape [1, 256], got {tuple(ref_s.shape)}")

    @torch.inference_mode()
    def prosody(self, ids: torch.Tensor, ref_s: torch.Tensor, speed: float = 1.0) -> Prosody:
        self._check(ids, ref_s)
        style = ref_s[:, STYLE_SPLIT:]
        d_en = self.bert_encoder(self.bert(ids)).transpose(1, 2)
        d = self.predictor.text_encoder(d_en, style)
        frames = self.predictor.durations(d, speed)
        durations = torch.round(frames).clamp(min=1).long().reshape(-1)
        aln = alignment(durations)
        en = d.transpose(1, 2) @ aln
        f0, n = self.predictor.curves(en, style)
        asr = self.text_encoder(ids) @ aln
        return Prosody(durations, f0, n, asr)

    @torch.inference_mode()
    def decode(
        self, p: Prosody, ref_s: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Audio [L] (float32, not clipped)."""
        return self.decoder(p.asr, p.f0, p.n, ref_s[:, :STYLE_SPLIT], generator).reshape(-1)

    def forward(
        self,
        ids: torch.Tensor,
        ref_s: torch.Tensor,
        speed: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(audio [L], durations [T])."""
        p = self.prosody(ids, ref_s, speed)
        return self.decode(p, ref_s, generator), p.durations
