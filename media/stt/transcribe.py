"""Long-form transcription: openai-whisper's sequential loop over 30-second windows.

Each window starts where the previous one's last complete segment ended (its seek), decodes
with temperature fallback, conditions on the text so far, and cuts segments at timestamp
tokens. Audio arrives as a block stream, so hours of audio need only a window of memory.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import numpy as np

from localllm.media.audio.chunk import SeekBuffer
from localllm.media.audio.mel import log_mel
from localllm.media.stt.alignment import TimedPiece, Word, add_word_timestamps
from localllm.media.stt.bundle import WhisperBundle
from localllm.media.stt.decoding import (
    TIME_PRECISION,
    DecodeOptions,
    DecodeResult,
    decode_with_fallback,
    detect_language,
    encode,
    sot_sequence,
)

# progress(seconds done, total seconds or None while the stream's length is unknown)
Progress = Callable[[float, float | None], None]
INPUT_STRIDE = 2  # mel frames per encoder position (conv2 has stride 2)


@dataclass(frozen=True)
class Segment:
    id: int
    seek: int  # mel frame where this segment's window began
    start: float
    end: float
    text: str
    tokens: tuple[int, ...]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float
    words: tuple[Word, ...] = ()  # filled when DecodeOptions.word_timestamps is set


@dataclass(frozen=True)
class Transcript:
    text: str
    segments: tuple[Segment, ...]
    language: str
    duration: float


def _check_language(bundle: WhisperBundle, opts: DecodeOptions) -> str | None:
    if bundle.multilingual:
        if opts.language is not None:
            bundle.tokenizer.special.language_id(opts.language)  # raises on an unknown code
        return opts.language
    if opts.task == "translate":
        raise ValueError(f"{bundle.name} is English-only: it cannot translate")
    if opts.language not in (None, "en"):
        raise ValueError(f"{bundle.name} is English-only: no language {opts.language!r}")
    return "en"


Piece = tuple[float, float, list[int]]  # start, end, tokens


def _segments(
    result: DecodeResult, ts_begin: int, offset: float, window_frames: int
) -> tuple[list[Piece], int]:
    """(start, end, tokens) pieces of one window, and how many mel frames they consumed."""
    toks = list(result.tokens)
    is_ts = [t >= ts_begin for t in toks]
    single_ending = is_ts[-2:] == [False, True]
    cuts = [i + 1 for i in range(len(toks) - 1) if is_ts[i] and is_ts[i + 1]]
    if cuts:
        if single_ending:
            cuts.append(len(toks))
        pieces, last = [], 0
        for cut in cuts:
            part = toks[last:cut]
            start = offset + (part[0] - ts_begin) * TIME_PRECISION
            end = offset + (part[-1] - ts_begin) * TIME_PRECISION
            pieces.append((start, end, part))
            last = cut
        if single_ending:
            return pieces, window_frames
        return pieces, (toks[last - 1] - ts_begin) * INPUT_STRIDE
    stamps = [t for t in toks if t >= ts_begin]
    duration = window_frames * TIME_PRECISION / INPUT_STRIDE
    if stamps and stamps[-1] != ts_begin:
        duration = (stamps[-1] - ts_begin) * TIME_PRECISION
    return [(offset, offset + duration, toks)], window_frames


def _clip(s: Segment, duration: float) -> Segment:
    words = tuple(
        replace(w, start=min(w.start, duration), end=min(w.end, duration)) for w in s.words
    )
    return replace(s, end=min(s.end, duration), words=words)


def transcribe(
    bundle: WhisperBundle,
    audio: np.ndarray | Iterable[np.ndarray],
    opts: DecodeOptions | None = None,
    progress: Progress | None = None,
    total_seconds: float | None = None,
) -> Transcript:
    """Transcribe 16 kHz mono audio (one array, or a stream of blocks) into timed segments."""
    opts = opts or DecodeOptions()
    language = _check_language(bundle, opts)
    spec, tok = bundle.mel, bundle.tokenizer
    ts_begin = tok.special.timestamp_begin
    if isinstance(audio, np.ndarray):
        total_seconds = len(audio) / spec.sample_rate
        audio = [audio]
    buf = SeekBuffer(audio)
    all_tokens: list[int] = []
    if opts.initial_prompt:  # the first window's prompt (and later ones' until a reset)
        all_tokens = tok.encode(" " + opts.initial_prompt.strip())
    prompt_reset = 0
    segments: list[Segment] = []
    seek = 0  # in mel frames
    last_speech = 0.0  # end of the last aligned speech, for word-timestamp boundary rules
    while buf.has_data(seek * spec.hop_length):
        window = buf.window(seek * spec.hop_length, spec.n_samples)
        frames = len(window) // spec.hop_length
        if frames == 0:
            break
        if opts.silence_peak is not None and float(np.abs(window).max()) < opts.silence_peak:
            seek += frames
            if progress is not None:
                progress(seek * spec.frame_seconds, total_seconds)
            continue
        mel = log_mel(window, spec, bundle.filters, pad_to=spec.n_samples)
        features = encode(bundle, mel)
        if language is None:
            language = next(iter(detect_language(bundle, features)))
        prompt = all_tokens[prompt_reset:] if opts.condition_on_previous_text else []
        result = decode_with_fallback(bundle, features, opts, language, prompt)
        offset = seek * spec.frame_seconds
        silent = (
            opts.no_speech_threshold is not None
            and result.no_speech_prob > opts.no_speech_threshold
            and not (
                opts.logprob_threshold is not None and result.avg_logprob > opts.logprob_threshold
            )
        )
        window_seek = seek
        if silent:
            seek += frames
        else:
            found, consumed = _segments(result, ts_begin, offset, frames)
            seek += consumed if consumed > 0 else frames  # always move forward
            pieces = [TimedPiece(start, end, part, []) for start, end, part in found]
            if opts.word_timestamps:
                sot = sot_sequence(bundle, opts.task, language)
                last_speech = add_word_timestamps(
                    bundle, features, sot, pieces, offset, frames, language, last_speech
                )
                toks = result.tokens
                single_ending = len(toks) >= 2 and toks[-2] < ts_begin <= toks[-1]
                ends = [p.words[-1].end for p in pieces if p.words]
                if not single_ending and ends and ends[-1] > offset:
                    # resume right after the last aligned word, not at the last timestamp
                    seek = round(ends[-1] / spec.frame_seconds)
            for piece in pieces:
                text = tok.decode(piece.tokens)
                if piece.end <= piece.start or not text.strip():
                    continue
                segments.append(
                    Segment(
                        len(segments),
                        window_seek,
                        round(piece.start, 3),
                        round(piece.end, 3),
                        text,
                        tuple(piece.tokens),
                        result.temperature,
                        result.avg_logprob,
                        result.compression_ratio,
                        result.no_speech_prob,
                        tuple(piece.words),
                    )
                )
                # timestamps too, as openai-whisper and faster-whisper: a prompt of bare text
                # leads the next window to bare text, one segment over all 30 s
                all_tokens += piece.tokens
            if not opts.condition_on_previous_text or result.temperature > 0.5:
                prompt_reset = len(all_tokens)
        if progress is not None:
            progress(min(seek * spec.frame_seconds, buf.total / spec.sample_rate), total_seconds)
    duration = buf.total / spec.sample_rate
    if progress is not None:
        progress(duration, duration)
    # the last window's timestamps may run past the end of the audio
    segments = [_clip(s, duration) for s in segments]
    text = "".join(s.text for s in segments).strip()
    return Transcript(text, tuple(segments), language or "en", duration)
