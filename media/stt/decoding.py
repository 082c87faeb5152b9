"""Decoding one 30-second window: language detection, beam search (at temperature 0) or
greedy/sampled decoding with Whisper's logit rules (suppressed tokens, blank, timestamp pairing),
and openai-whisper's temperature fallback on compression-ratio and average-logprob thresholds.
"""

import math
import zlib
from dataclasses import dataclass

import torch

from localllm.media.stt.beam import beam_search, best_hypothesis
from localllm.media.stt.bundle import WhisperBundle
from localllm.media.stt.model import KVCache

TIME_PRECISION = 0.02  # seconds per timestamp token
MAX_BEAM_SIZE = 16  # each beam is a decoder row per step: bounds one request's work


@dataclass(frozen=True)
class DecodeOptions:
    """openai-whisper's transcribe() defaults, with beam search at temperature 0 as its CLI,
    faster-whisper and whisper.cpp decode by default."""

    task: str = "transcribe"  # or "translate" (to English)
    language: str | None = None  # None: detect from the first window
    temperatures: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    # at temperature 0: beams kept (1 = greedy); higher temperatures sample one sequence
    beam_size: int = 5
    patience: float = 1.0  # stop once round(beam_size * patience) hypotheses have ended
    length_penalty: float = 1.0  # rank by sum_logprob / length ** this (1: the average)
    compression_ratio_threshold: float | None = 2.4
    logprob_threshold: float | None = -1.0
    no_speech_threshold: float | None = 0.6
    # windows whose peak stays below this are skipped undecoded: on digital silence Whisper
    # tends to invent a word ("you") with high confidence, which no threshold above catches
    silence_peak: float | None = 1e-3
    condition_on_previous_text: bool = True
    initial_prompt: str | None = None
    without_timestamps: bool = False
    word_timestamps: bool = False  # align each segment's words to the audio (cross-attention)
    max_initial_timestamp: float = 1.0
    suppress_blank: bool = True
    sample_len: int | None = None  # default: half the text context (224)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.task not in ("transcribe", "translate"):
            raise ValueError(f"task must be 'transcribe' or 'translate', not {self.task!r}")
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise ValueError("temperatures must be a non-empty list of values >= 0")
        if not 1 <= self.beam_size <= MAX_BEAM_SIZE:
            raise ValueError(f"beam_size must be between 1 and {MAX_BEAM_SIZE}")
        if not self.patience > 0 or not math.isfinite(self.patience):
            raise ValueError("patience must be > 0")
        if not math.isfinite(self.length_penalty):
            raise ValueError("length_penalty must be a finite number")


@dataclass(frozen=True)
class DecodeResult:
    """One window's sampled tokens (no prompt, no end token) and their quality figures."""

    tokens: tuple[int, ...]
    text: str
    language: str
    avg_logprob: float
    no_speech_prob: float
    temperature: float
    compression_ratio: float


def compression_ratio(text: str) -> float:
    raw = text.encode("utf-8")
    return len(raw) / len(zlib.compress(raw)) if raw else 0.0


@torch.inference_mode()
def encode(bundle: WhisperBundle, mel: torch.Tensor) -> torch.Tensor:
    """Audio features [1, n_audio_ctx, d] of one [n_mels, 3000] window."""
    return bundle.model.encoder(mel.to(bundle.model.device)[None])


@torch.inference_mode()
def detect_language(bundle: WhisperBundle, features: torch.Tensor) -> dict[str, float]:
    """Language code -> probability, from the decoder's first step after <|startoftranscript|>."""
    sp = bundle.tokenizer.special
    if not bundle.multilingual:
        return {"en": 1.0}
    cache = bundle.model.new_cache(features)
    logits = bundle.model.decoder(torch.tensor([[sp.sot]], device=features.device), cache)[0, -1]
    ids = torch.arange(sp.sot + 1, sp.sot + 1 + len(sp.languages))
    probs = logits[ids.to(logits.device)].softmax(-1).tolist()
    return dict(sorted(zip(sp.languages, probs, strict=True), key=lambda kv: -kv[1]))


def _apply_rules(
    logits: torch.Tensor, sampled: list[int], bundle: WhisperBundle, opts: DecodeOptions
) -> None:
    """Whisper's logit filters, in place on one step's [vocab] logits."""
    sp = bundle.tokenizer.special
    neg = -math.inf
    if not sampled and opts.suppress_blank:
        logits[[*bundle.tokenizer.encode(" "), sp.eot]] = neg
    suppress = [*bundle.suppress, sp.transcribe, sp.translate, sp.sot, sp.sot_prev, sp.sot_lm]
    if sp.no_speech >= 0:
        suppress.append(sp.no_speech)
    logits[[i for i in suppress if i < logits.shape[0]]] = neg
    if opts.without_timestamps:
        return
    ts = sp.timestamp_begin
    logits[sp.no_timestamps] = neg
    last_ts = len(sampled) >= 1 and sampled[-1] >= ts
    penult_ts = len(sampled) < 2 or sampled[-2] >= ts
    if last_ts:
        if penult_ts:  # a pair just closed: text (or end) must follow
            logits[ts:] = neg
        else:  # an open segment's end timestamp: no text
            logits[: sp.eot] = neg
    stamps = [t for t in sampled if t >= ts]
    if stamps:  # timestamps never decrease, and a segment has non-zero length
        floor = stamps[-1] if last_ts and not penult_ts else stamps[-1] + 1
        logits[ts:floor] = neg
    if not sampled:  # the first token is a timestamp, and an early one
        logits[:ts] = neg
        logits[ts + round(opts.max_initial_timestamp / TIME_PRECISION) + 1 :] = neg
    logprobs = logits.float().log_softmax(-1)
    if logprobs[ts:].logsumexp(-1) > logprobs[:ts].max():
        logits[:ts] = neg  # timestamps together outweigh the best text token


def sot_sequence(bundle: WhisperBundle, task: str, language: str) -> list[int]:
    """<|startoftranscript|>, then language and task on a multilingual model."""
    sp = bundle.tokenizer.special
    if not bundle.multilingual:
        return [sp.sot]
    return [
        sp.sot,
        sp.language_id(language),
        sp.translate if task == "translate" else sp.transcribe,
    ]


@torch.inference_mode()
def decode_window(
    bundle: WhisperBundle,
    features: torch.Tensor,
    opts: DecodeOptions,
    language: str,
    temperature: float,
    prompt: list[int] | None = None,
) -> DecodeResult:
    """Decode one window's features at one temperature: beam search at 0 when beam_size > 1."""
    model, tok = bundle.model, bundle.tokenizer
    sp, n_ctx = tok.special, model.config.n_text_ctx
    sot_seq = sot_sequence(bundle, opts.task, language)
    if opts.without_timestamps:
        sot_seq.append(sp.no_timestamps)
    prefix = [sp.sot_prev, *prompt[-(n_ctx // 2 - 1) :]] if prompt else []
    initial = prefix + sot_seq
    dev = features.device
    cache = model.new_cache(features)
    logits = model.decoder(torch.tensor([initial], device=dev), cache)[0]
    no_speech = logits[len(prefix)].softmax(-1)[sp.no_speech].item() if sp.no_speech >= 0 else 0.0
    if temperature == 0 and opts.beam_size > 1:
        # tokens fed stay within the context: the prompt, then all but the last one decoded
        max_len = min(opts.sample_len or n_ctx // 2, n_ctx - len(initial) + 1)
        rules = lambda row, seq: _apply_rules(row, seq, bundle, opts)
        found = beam_search(
            model, cache, logits[-1], rules, sp.eot,
            opts.beam_size, opts.patience, opts.length_penalty, max_len,
        )  # fmt: skip
        best = best_hypothesis(found)
        sampled, sum_lp = list(best.tokens), best.sum_logprob
    else:
        sampled, sum_lp = _sample(bundle, cache, logits[-1], opts, temperature, len(initial))
    text = tok.decode(sampled)
    return DecodeResult(
        tokens=tuple(sampled),
        text=text,
        language=language,
        avg_logprob=sum_lp / (len(sampled) + 1),
        no_speech_prob=no_speech,
        temperature=temperature,
        compression_ratio=compression_ratio(text),
    )


def _sample(
    bundle: WhisperBundle,
    cache: KVCache,
    step: torch.Tensor,
    opts: DecodeOptions,
    temperature: float,
    n_prompt: int,
) -> tuple[list[int], float]:
    """Greedy (temperature 0) or sampled tokens after the prompt, and their summed logprob."""
    model, sp = bundle.model, bundle.tokenizer.special
    n_ctx, dev = model.config.n_text_ctx, step.device
    gen = torch.Generator().manual_seed(opts.seed)
    sampled: list[int] = []
    sum_lp = 0.0
    for _ in range(opts.sample_len or n_ctx // 2):
        step = step.float().cpu()
        _apply_rules(step, sampled, bundle, opts)
        if temperature == 0:
            nxt = int(step.argmax())
        else:
            nxt = int(torch.multinomial((step / temperature).softmax(-1), 1, generator=gen))
        sum_lp += float(step.log_softmax(-1)[nxt])
        if nxt == sp.eot:
            break
        sampled.append(nxt)
        if n_prompt + len(sampled) >= n_ctx:
            break
        step = model.decoder(torch.tensor([[nxt]], device=dev), cache)[0, -1]
    return sampled, sum_lp


def decode_with_fallback(
    bundle: WhisperBundle,
    features: torch.Tensor,
    opts: DecodeOptions,
    language: str,
    prompt: list[int] | None = None,
) -> DecodeResult:
    """Decode at rising temperatures until the output is neither repetitive nor improbable."""
    result = None
    for t in opts.temperatures:
        result = decode_window(bundle, features, opts, language, t, prompt)
        too_repetitive = (
            opts.compression_ratio_threshold is not None
            and result.compression_ratio > opts.compression_ratio_threshold
        )
        too_unlikely = (
            opts.logprob_threshold is not None and result.avg_logprob < opts.logprob_threshold
        )
        threshold = opts.no_speech_threshold
        silent = threshold is not None and result.no_speech_prob > threshold
        if not too_repetitive and (not too_unlikely or silent):
            break
    assert result is not None
    return result
