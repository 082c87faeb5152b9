"""`MusicGen`: a Hugging Face MusicGen or MusicGen-Melody folder loaded for generation, and the
generation loop: prompt -> T5 text states -> conditioning (cross-attention states, or the
melody model's prefix) -> the codebook LM stepped over the delay pattern with classifier-free
guidance (conditional and unconditional rows batched) -> EnCodec -> waveform.

A step reports progress in seconds of audio. The steps themselves are `steps.py`'s: the cached
step on the CPU, a captured CUDA graph of it on CUDA; `cached=False` runs the same loop over the
LM's plain reference forward (everything recomputed each step), which the fast paths are
tested against.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from localllm.media.music import delay
from localllm.media.music.chroma import chroma, null_chroma, tile_prefix
from localllm.media.music.config import MusicModelError, load_config
from localllm.media.music.encodec import Encodec
from localllm.media.music.extend import default_window, extended_codes
from localllm.media.music.lm import MusicLM
from localllm.media.music.sampling import SamplingOptions, choose, guide
from localllm.media.music.steps import CachedSteps, Condition, Recompute, StaticSteps
from localllm.media.music.t5 import T5Encoder
from localllm.media.music.weights import Weights

# how each decode step runs: auto = a captured CUDA graph on CUDA, the cached step elsewhere;
# static = the graph's step run eagerly (tests)
STEPS = ("auto", "cached", "static", "graph")
MAX_SECONDS = 300.0  # a request limit, checked before any model work; models have their own
Progress = Callable[[float, float], None]  # (seconds of audio done, seconds in all)


@dataclass(frozen=True)
class Music:
    samples: np.ndarray  # (channels, samples) float32
    sample_rate: int
    codes: torch.Tensor  # (K, frames)

    @property
    def seconds(self) -> float:
        return self.samples.shape[1] / self.sample_rate


def check_seconds(seconds: float) -> None:
    if not (seconds > 0) or seconds > MAX_SECONDS:
        raise ValueError(f"duration must be > 0 and <= {MAX_SECONDS:g} seconds, got {seconds:g}")


class MusicGen:
    """A loaded model. Not thread-safe: one generation at a time.

    `dtype` is the codebook LM's (bfloat16 halves the bytes each step reads); the T5 encoder,
    the conditioning projections and EnCodec always run in float32 (they run once, and
    EnCodec's output is the audio itself)."""

    def __init__(self, folder: str | Path, device: str = "cpu", dtype=torch.float32):
        from tokenizers import Tokenizer

        self.folder = Path(folder)
        self.config = cfg = load_config(self.folder)
        self.name = self.folder.name
        w = Weights(self.folder, device, torch.float32)
        self.lm_dtype = dtype
        self.steps = "auto"  # of STEPS
        self.device = w.device
        self.text = T5Encoder(cfg.text, w)
        lm_w = w if dtype == torch.float32 else Weights(self.folder, device, dtype)
        self.lm = MusicLM(cfg.decoder, lm_w, cross=not cfg.melody)
        self.codec = Encodec(cfg.codec, w)
        self.text_proj = self._linear(w, "enc_to_dec_proj")
        self.chroma_proj = self._linear(w, "audio_enc_to_dec_proj") if cfg.melody else None
        tok = self.folder / "tokenizer.json"
        try:
            self.tokenizer = Tokenizer.from_file(str(tok))
        except Exception as e:  # tokenizers raises its own Exception type
            raise MusicModelError(f"{tok}: cannot load the T5 tokenizer ({e})") from None

    @staticmethod
    def _linear(w: Weights, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        if f"{name}.weight" not in w:
            return None  # widths agree: the states go in as they are
        return w.get(f"{name}.weight"), w.get(f"{name}.bias")

    @property
    def sample_rate(self) -> int:
        return self.config.sample_rate

    @property
    def channels(self) -> int:
        return self.config.decoder.audio_channels

    def max_seconds(self, prompt_tokens: int = 0) -> float:
        """The longest audio this model's position table holds (the prefix counted)."""
        c = self.config
        used = max(delay.row_delays(c.decoder.num_codebooks, self.channels)) + 1  # BOS, delays
        if c.melody:
            used += c.chroma.chroma_length + prompt_tokens
        return max(c.decoder.max_positions - used, 0) / c.frame_rate

    # -- conditioning -------------------------------------------------------------------------

    def tokenize(self, prompt: str) -> torch.Tensor:
        if not prompt.strip():
            raise ValueError("the prompt is empty: describe the music to make")
        ids = self.tokenizer.encode(prompt).ids
        return torch.tensor([ids], dtype=torch.long)

    def _text_states(self, ids: torch.Tensor) -> torch.Tensor:
        states = self.text(ids.to(self.device))
        if self.text_proj is not None:
            states = F.linear(states, *self.text_proj)
        return states

    def _condition(self, ids, melody: np.ndarray | None, opts: SamplingOptions, cached: bool):
        rows = 2 if opts.cfg else 1
        text = self._text_states(ids)  # (1, S, hidden); one prompt: no padding
        if rows == 2:  # the unconditional row: zero text states, masked out
            text = torch.cat([text, torch.zeros_like(text)])
        cfg = self.config
        if cfg.melody:
            feats = chroma(melody, cfg.chroma) if melody is not None else null_chroma(cfg.chroma)
            feats = [feats, null_chroma(cfg.chroma).expand_as(feats)][:rows]
            audio = torch.stack(feats).to(self.device, text.dtype)
            if self.chroma_proj is not None:
                audio = F.linear(audio, *self.chroma_proj)
            audio = tile_prefix(audio, cfg.chroma.chroma_length)
            return Condition(rows, prefix=torch.cat([audio, text], dim=1).to(self.lm_dtype))
        text = text.to(self.lm_dtype)
        mask = torch.ones(text.shape[:2], device=self.device)
        mask[1:] = 0
        cond = Condition(rows, cross=text, cross_mask=mask)
        if cached:
            cond.cross_kv = self.lm.cross_kv(text[:1])
        return cond

    # -- the codec ----------------------------------------------------------------------------

    def encode(self, audio: np.ndarray) -> torch.Tensor:
        """(channels, samples) audio to (K, frames) codes, stereo rows interleaved L, R."""
        x = torch.from_numpy(np.asarray(audio, dtype=np.float32)).to(self.device)
        codes = self.codec.encode(x)  # channels as the batch: (channels, Q, frames)
        return codes.transpose(0, 1).reshape(-1, codes.shape[-1])

    def decode(self, codes: torch.Tensor) -> np.ndarray:
        """(K, frames) codes to (channels, samples) float32 audio."""
        per_channel = torch.stack([codes[c :: self.channels] for c in range(self.channels)])
        return self.codec.decode(per_channel.to(self.device)).float().cpu().numpy()

    # -- generation ---------------------------------------------------------------------------

    @torch.inference_mode()
    def codes(
        self,
        prompt: str,
        frames: int,
        opts: SamplingOptions,
        melody: np.ndarray | None = None,
        prompt_codes: torch.Tensor | None = None,
        progress: Progress | None = None,
        cached: bool = True,
        steps: str | None = None,
    ) -> torch.Tensor:
        """(K, frames) codes: `prompt_codes` (K, P) first, then generated ones."""
        opts.check()
        if melody is not None and not self.config.melody:
            raise ValueError(f"{self.name} is not a melody model (use a musicgen-melody model)")
        ids = self.tokenize(prompt)
        dec = self.config.decoder
        pat = delay.pattern(
            frames, dec.num_codebooks, self.channels, dec.pad_token_id, prompt_codes
        )
        start = delay.first_free(pat)
        seq = pat.clone().to(self.device)
        pat = pat.to(self.device)
        cond = self._condition(ids, melody, opts, cached)
        gen = torch.Generator(device=self.device)
        gen.manual_seed(opts.seed if opts.seed is not None else secrets.randbits(63))
        step = self._steps(cond, pat.shape[1], cached, steps or self.steps)
        logits = step.first(seq[:, :start])
        total = pat.shape[1]
        for t in range(start, total):
            scores = guide(logits, opts.guidance_scale) if cond.rows == 2 else logits[0]
            new = choose(scores.float(), opts, gen)
            seq[:, t] = torch.where(pat[:, t] == delay.FREE, new, pat[:, t])
            if progress is not None:
                progress(frames * (t + 1 - start) / (total - start) / self.config.frame_rate,
                         frames / self.config.frame_rate)  # fmt: skip
            if t + 1 < total:
                logits = step.next(seq[:, : t + 1])
        return delay.undelay(seq, self.channels, frames).cpu()

    def _steps(self, cond: Condition, length: int, cached: bool, kind: str):
        if kind not in STEPS:
            raise ValueError(f"steps must be one of {', '.join(STEPS)}, got {kind!r}")
        if not cached:
            return Recompute(self.lm, cond)
        if kind == "auto":
            kind = "graph" if self.device.type == "cuda" else "cached"
        if kind == "graph" and self.device.type != "cuda":
            raise ValueError("steps='graph' (a captured CUDA graph) needs a CUDA device")
        if kind == "cached":
            return CachedSteps(self.lm, cond, length)
        return StaticSteps(self.lm, cond, length, capture=kind == "graph")

    def generate(
        self,
        prompt: str,
        seconds: float,
        opts: SamplingOptions,
        melody: np.ndarray | None = None,
        continuation: np.ndarray | None = None,
        progress: Progress | None = None,
        window: float | None = None,
        stride: float | None = None,
    ) -> Music:
        """`seconds` of music for `prompt`. `melody`: mono audio at the model's rate (melody
        models); `continuation`: (channels, samples) audio the result starts with and goes on
        from (`seconds` counts it). Past what the position table holds (or with `window`),
        windows of `window` seconds each re-prompted with the last `window - stride` seconds
        (default: audiocraft's 30 and 18 s, scaled to the model; `extend.py`)."""
        check_seconds(seconds)
        rate = self.config.frame_rate
        frames = round(seconds * rate)
        limit = self.max_seconds(len(self.tokenizer.encode(prompt).ids))
        prompt_codes = None
        if continuation is not None:
            prompt_codes = self.encode(continuation)
            if prompt_codes.shape[1] >= frames:
                clip = continuation.shape[1] / self.sample_rate
                raise ValueError(f"duration {seconds:g} s must be longer than the clip to "
                                 f"continue ({clip:.2f} s)")  # fmt: skip
        if frames <= limit * rate and window is None:
            codes = self.codes(prompt, frames, opts, melody, prompt_codes, progress)
            return Music(self.decode(codes), self.sample_rate, codes)
        # past the position table: audiocraft's windows (extend.py)
        window, stride = (window, stride or window * 0.6) if window else default_window(limit)
        if window > limit:
            raise ValueError(f"window {window:g} s is longer than {self.name} holds "
                             f"({limit:.1f} s: its position table)")  # fmt: skip

        def one(n, o, mel, pc, prog):
            return self.codes(prompt, n, o, mel, pc, prog)

        codes = extended_codes(one, frames, rate, self.sample_rate, opts, window, stride,
                               melody, prompt_codes, progress)  # fmt: skip
        return Music(self.decode(codes), self.sample_rate, codes)
