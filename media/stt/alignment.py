"""Token-to-audio alignment for word timestamps: cross-attention of the alignment heads, DTW.

openai-whisper's method: one teacher-forced decoder pass over [sot..., <|notimestamps|>, text,
<|endoftext|>] keeps the cross-attention of the alignment heads (softmax over the window's real
frames), normalises each head over tokens, median-filters along time, averages the heads, and
aligns tokens to audio frames by dynamic time warping on the negated matrix.
"""

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from localllm.media.stt.bundle import WhisperBundle
from localllm.media.stt.words import merge_punctuations, split_to_word_tokens

TOKENS_PER_SECOND = 50  # encoder positions per second (20 ms each)
MEDFILT_WIDTH = 7


@dataclass
class Timing:
    """One word of an alignment, in seconds from the window's start (mutable: merged, clipped)."""

    word: str
    tokens: list[int]
    start: float
    end: float
    probability: float


def alignment_heads(bundle: WhisperBundle) -> list[tuple[int, int]]:
    """(decoder layer, head) pairs whose cross-attention follows the speech: the checkpoint's
    own list, else every head of the last half of the decoder layers (openai-whisper's default)."""
    if bundle.alignment_heads:
        return list(bundle.alignment_heads)
    cfg = bundle.model.config
    layers = range(cfg.n_text_layer // 2, cfg.n_text_layer)
    return [(layer, head) for layer in layers for head in range(cfg.n_text_head)]


def median_filter(x: torch.Tensor, width: int) -> torch.Tensor:
    """Median over a `width` window along the last axis, reflect-padded (odd width)."""
    pad = width // 2
    if x.shape[-1] <= pad:
        return x  # reflect padding needs more frames than the pad
    padded = F.pad(x, (pad, pad), mode="reflect")
    return padded.unfold(-1, width, 1).sort(dim=-1).values[..., pad]


def dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Minimum-cost monotonic path through `cost` [tokens, frames]: (token, frame) index arrays.

    Cells on one anti-diagonal depend only on earlier diagonals, so each diagonal is one numpy
    step; ties break as openai-whisper's loop does (diagonal, then up, else left)."""
    n, m = cost.shape
    acc = np.full((n + 1, m + 1), np.inf)
    acc[0, 0] = 0.0
    trace = np.full((n + 1, m + 1), -1, dtype=np.int8)
    for k in range(2, n + m + 1):
        i = np.arange(max(1, k - m), min(n, k - 1) + 1)
        j = k - i
        c0, c1, c2 = acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1]
        t = np.where((c0 < c1) & (c0 < c2), 0, np.where((c1 < c0) & (c1 < c2), 1, 2))
        acc[i, j] = cost[i - 1, j - 1] + np.choose(t, [c0, c1, c2])
        trace[i, j] = t
    trace[0, :], trace[:, 0] = 2, 1
    i, j, path = n, m, []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        step = trace[i, j]
        if step == 0:
            i, j = i - 1, j - 1
        elif step == 1:
            i -= 1
        else:
            j -= 1
    out = np.array(path[::-1]).T
    return out[0], out[1]


@torch.inference_mode()
def cross_attention(
    bundle: WhisperBundle, tokens: list[int], features: torch.Tensor, heads: list[tuple[int, int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [T, vocab] of one teacher-forced pass and the pre-softmax cross-attention scores
    [len(heads), T, n_audio_ctx] of the given heads."""
    dec = bundle.model.decoder
    ids = torch.tensor([tokens], device=features.device)
    x = dec.embed(ids) + dec.positions[: len(tokens)]
    wanted: dict[int, list[int]] = {}
    for layer, head in heads:
        wanted.setdefault(layer, []).append(head)
    scores: dict[tuple[int, int], torch.Tensor] = {}
    for li, layer in enumerate(dec.layers):
        h = layer.attn_ln(x)
        x = x + layer.attn.attend(h, *layer.attn.kv(h), causal_from=0)
        c = layer.cross_ln(x)
        k, v = layer.cross.kv(features)
        if li in wanted:
            q = layer.cross.split(layer.cross.q(c)).float()
            qk = (q @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
            for head in wanted[li]:
                scores[(li, head)] = qk[0, head]
        x = x + layer.cross.attend(c, k, v)
        x = x + layer.mlp(layer.mlp_ln(x))
    logits = (dec.ln(x) @ dec.embed.weight.T).float()[0]
    return logits, torch.stack([scores[lh] for lh in heads])


def find_alignment(
    bundle: WhisperBundle,
    features: torch.Tensor,
    sot_sequence: list[int],
    text_tokens: list[int],
    num_frames: int,
    language: str,
) -> list[Timing]:
    """Words of `text_tokens` with start/end (seconds into the window) and mean token
    probability; `num_frames` is the window's count of real mel frames."""
    if not text_tokens:
        return []
    sp = bundle.tokenizer.special
    tokens = [*sot_sequence, sp.no_timestamps, *text_tokens, sp.eot]
    logits, qk = cross_attention(bundle, tokens, features, alignment_heads(bundle))
    n_sot = len(sot_sequence)
    # row n_sot (the <|notimestamps|> input) predicts the first text token
    probs = logits[n_sot : n_sot + len(text_tokens), : sp.eot].softmax(-1)
    token_probs = probs[torch.arange(len(text_tokens)), torch.tensor(text_tokens)].tolist()
    weights = qk[:, :, : max(num_frames // 2, 1)].softmax(-1)
    std, mean = torch.std_mean(weights, dim=-2, keepdim=True, unbiased=False)
    weights = median_filter((weights - mean) / std, MEDFILT_WIDTH)
    matrix = weights.mean(0)[n_sot:-1].double().cpu().numpy()
    text_idx, time_idx = dtw(-matrix)
    words, word_tokens = split_to_word_tokens(bundle.tokenizer, text_tokens, language)
    if not words:
        return []
    # each word starts where the path first enters its first token's row
    bounds = np.pad(np.cumsum([len(t) for t in word_tokens]), (1, 0))
    jumps = np.pad(np.diff(text_idx), (1, 0), constant_values=1).astype(bool)
    jump_times = time_idx[jumps] / TOKENS_PER_SECOND
    return [
        Timing(
            word,
            list(toks),
            float(jump_times[bounds[w]]),
            float(jump_times[bounds[w + 1]]),
            float(np.mean(token_probs[bounds[w] : bounds[w + 1]])),
        )
        for w, (word, toks) in enumerate(zip(words, word_tokens, strict=True))
    ]


@dataclass(frozen=True)
class Word:
    """One word of a segment: text (with its leading space), start/end seconds, probability."""

    word: str
    start: float
    end: float
    probability: float


@dataclass
class TimedPiece:
    """A segment of one window while its words are placed (start/end may move to the words)."""

    start: float
    end: float
    tokens: list[int]
    words: list[Word]


def _clip_sentence_ends(alignment: list[Timing], max_duration: float) -> None:
    # a word at a sentence boundary may absorb the pause: cap it at twice the median word
    marks = ".。!！?？"
    for i in range(1, len(alignment)):
        if alignment[i].end - alignment[i].start > max_duration:
            if alignment[i].word in marks:
                alignment[i].end = alignment[i].start + max_duration
            elif alignment[i - 1].word in marks:
                alignment[i].start = alignment[i].end - max_duration


def _fit_piece(piece: TimedPiece, words: list[Timing], median: float, last_speech: float) -> None:
    """openai-whisper's boundary rules between a segment's words and its timestamps."""
    longest = median * 2
    first = words[0]
    if first.end - last_speech > median * 4 and (
        first.end - first.start > longest
        or (len(words) > 1 and words[1].end - first.start > longest * 2)
    ):  # the first words after a pause: not longer than twice the median
        if len(words) > 1 and words[1].end - words[1].start > longest:
            boundary = max(words[1].end / 2, words[1].end - longest)
            first.end = words[1].start = boundary
        first.start = max(0.0, first.end - longest)
    if piece.start < first.end and piece.start - 0.5 > first.start:
        first.start = max(0.0, min(first.end - median, piece.start))
    else:
        piece.start = first.start
    last = words[-1]
    if piece.end > last.start and piece.end + 0.5 < last.end:
        last.end = max(last.start + median, piece.end)
    else:
        piece.end = last.end
    # whisper may leave the first word starting before its segment: widen the segment instead
    piece.start, piece.end = min(piece.start, first.start), max(piece.end, last.end)


def add_word_timestamps(
    bundle: WhisperBundle,
    features: torch.Tensor,
    sot_sequence: list[int],
    pieces: list[TimedPiece],
    offset: float,
    num_frames: int,
    language: str,
    last_speech: float,
) -> float:
    """Fill each piece's words (absolute seconds) from one alignment of the whole window, and
    move piece boundaries to them as openai-whisper does; returns the new last-speech time."""
    eot = bundle.tokenizer.special.eot
    per_piece = [[t for t in p.tokens if t < eot] for p in pieces]
    text_tokens = [t for toks in per_piece for t in toks]
    alignment = find_alignment(bundle, features, sot_sequence, text_tokens, num_frames, language)
    durations = np.array([w.end - w.start for w in alignment])
    durations = durations[durations.nonzero()]
    median = min(0.7, float(np.median(durations))) if len(durations) else 0.0
    if len(durations):
        _clip_sentence_ends(alignment, median * 2)
    merge_punctuations(alignment)
    index = 0
    for piece, toks in zip(pieces, per_piece, strict=True):
        saved, words = 0, []
        while index < len(alignment) and saved < len(toks):
            timing = alignment[index]
            if timing.word:
                start, end = round(offset + timing.start, 2), round(offset + timing.end, 2)
                words.append(Timing(timing.word, [], start, end, timing.probability))
            saved += len(timing.tokens)
            index += 1
        if words:
            _fit_piece(piece, words, median, last_speech)
            last_speech = piece.end
        piece.words = [Word(w.word, w.start, w.end, w.probability) for w in words]
    return last_speech
