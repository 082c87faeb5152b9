"""Word timestamps: DTW and the median filter against plain reference loops, word splitting on
the real tokenizer, the alignment pass against the decoder, and real Whisper base words against
faster-whisper's `word_timestamps=True` on the same CTranslate2 weights and espeak-ng speech."""

import importlib.util
import statistics
from pathlib import Path

import numpy as np
import pytest
import soxr
import torch

from localllm.media.audio.mel import log_mel
from localllm.media.stt import DecodeOptions, load_whisper, transcribe
from localllm.media.stt.alignment import alignment_heads, cross_attention, dtw, median_filter
from localllm.media.stt.decoding import encode
from localllm.media.stt.tokenizer import WhisperTokenizer
from localllm.media.stt.words import merge_punctuations, split_to_word_tokens

_TOOL = Path(__file__).resolve().parents[2] / "tools" / "espeak_clips.py"
_spec = importlib.util.spec_from_file_location("espeak_clips", _TOOL)
clips = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(clips)

# Measured 2026-11-30 (this container, torch CPU, faster-whisper 1.2.1 float32, 3 sentences):
# 26/26 words equal, |start| and |end| differences median 0.00 s, max 0.08 s.
MEDIAN_TOL = 0.05
MAX_TOL = 0.2


def _reference_dtw(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """openai-whisper's dtw_cpu, as plain loops."""
    n, m = x.shape
    cost = np.ones((n + 1, m + 1)) * np.inf
    trace = -np.ones((n + 1, m + 1))
    cost[0, 0] = 0
    for j in range(1, m + 1):
        for i in range(1, n + 1):
            c0, c1, c2 = cost[i - 1, j - 1], cost[i - 1, j], cost[i, j - 1]
            if c0 < c1 and c0 < c2:
                c, t = c0, 0
            elif c1 < c0 and c1 < c2:
                c, t = c1, 1
            else:
                c, t = c2, 2
            cost[i, j] = x[i - 1, j - 1] + c
            trace[i, j] = t
    i, j = n, m
    trace[0, :], trace[:, 0] = 2, 1
    path = []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        if trace[i, j] == 0:
            i, j = i - 1, j - 1
        elif trace[i, j] == 1:
            i -= 1
        else:
            j -= 1
    out = np.array(path[::-1]).T
    return out[0], out[1]


@pytest.mark.parametrize("shape", [(1, 1), (3, 9), (9, 3), (12, 80)])
def test_dtw_matches_the_reference_loop(shape):
    rng = np.random.default_rng(sum(shape))
    for cost in (rng.normal(size=shape), rng.integers(0, 3, size=shape).astype(float)):  # ties
        got, want = dtw(cost), _reference_dtw(cost)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


def test_median_filter_matches_a_windowed_median():
    x = torch.randn(2, 3, 20)
    got = median_filter(x, 7)
    padded = np.pad(x.numpy(), ((0, 0), (0, 0), (3, 3)), mode="reflect")
    want = np.stack([np.median(padded[..., i : i + 7], axis=-1) for i in range(20)], axis=-1)
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=0)
    short = torch.randn(1, 2, 3)  # fewer frames than the pad: unchanged, as whisper does
    assert torch.equal(median_filter(short, 7), short)


class _W:
    def __init__(self, word: str, tokens: list[int]):
        self.word, self.tokens = word, tokens


def test_words_from_tokens_and_punctuation_merging(whisper_tiny_en):
    tok = WhisperTokenizer.from_file(whisper_tiny_en / "tokenizer.json")
    text = ' He said "unbelievable", then left. (Really?)'
    ids = tok.encode(text)
    words, groups = split_to_word_tokens(tok, ids, "en")
    assert "".join(words) == text and [t for g in groups for t in g] == ids
    # BPE pieces join the word before them unless they start with a space or are punctuation
    # (' "' is; '",' and '?)' are not, as in whisper)
    assert words == [" He", " said", ' "unbelievable",', " then", " left", ".", " (Really?)"]
    items = [_W(w, g) for w, g in zip(words, groups, strict=True)]
    merge_punctuations(items)
    kept = [w.word for w in items if w.word]
    assert kept == [" He", " said", ' "unbelievable",', " then", " left.", " (Really?)"]
    assert [t for w in items for t in w.tokens] == ids  # merging moves tokens, loses none
    # a character split across tokens stays one piece; no-space scripts split per piece
    ja = tok.encode("こんにちは世界")
    pieces, groups = split_to_word_tokens(tok, ja, "ja")
    assert len(ja) > 7 and pieces == list("こんにちは世界")


def test_alignment_heads_come_from_the_config_else_the_last_half(whisper_base, whisper_tiny_en):
    base = load_whisper(whisper_base)
    assert base.alignment_heads == ((3, 1), (4, 2), (4, 3), (4, 7), (5, 1), (5, 2), (5, 4), (5, 6))
    from dataclasses import replace

    bare = replace(load_whisper(whisper_tiny_en), alignment_heads=())
    assert alignment_heads(bare) == [(layer, h) for layer in (2, 3) for h in range(6)]


def test_alignment_pass_equals_the_decoder(whisper_tiny_en):
    bundle = load_whisper(whisper_tiny_en)
    audio = np.random.default_rng(0).normal(0, 0.05, 16_000).astype(np.float32)
    features = encode(bundle, log_mel(audio, bundle.mel, bundle.filters, pad_to=480_000))
    sp = bundle.tokenizer.special
    tokens = [sp.sot, sp.no_timestamps, *bundle.tokenizer.encode(" Hello world."), sp.eot]
    heads = [(0, 1), (3, 5)]
    logits, qk = cross_attention(bundle, tokens, features, heads)
    with torch.inference_mode():
        cache = bundle.model.new_cache(features)
        want = bundle.model.decoder(torch.tensor([tokens]), cache)[0]
        # the scores of layer 3 head 5 by hand: the layer's input is the decoder up to layer 2
        layer = bundle.model.decoder.layers[3]
        q_in = None

        def grab(_module, args, _out):
            nonlocal q_in
            q_in = args[0]

        handle = layer.cross_ln.register_forward_hook(lambda m, a, o: grab(m, (o,), o))
        bundle.model.decoder(torch.tensor([tokens]), bundle.model.new_cache(features))
        handle.remove()
        q = layer.cross.split(layer.cross.q(q_in))[0, 5]
        k = layer.cross.split(layer.cross.k(features))[0, 5]
        scores = q @ k.T / q.shape[-1] ** 0.5
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-3)
    assert qk.shape == (2, len(tokens), 1500)
    torch.testing.assert_close(qk[1], scores, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    pytest.importorskip("espeakng_loader", reason="espeakng-loader ships the espeak-ng library")
    audio, sr = clips.synthesize(" ".join(clips.SENTENCES[:3]))
    return soxr.resample(audio, sr, 16_000).astype(np.float32)


def test_base_words_match_faster_whisper(whisper_base, speech):
    fw = pytest.importorskip("faster_whisper", reason="faster-whisper is the reference")
    greedy = DecodeOptions(word_timestamps=True, beam_size=1)  # as the reference's beam_size=1
    ours = transcribe(load_whisper(whisper_base), speech, greedy)
    model = fw.WhisperModel(str(whisper_base), device="cpu", compute_type="float32")
    segs, _ = model.transcribe(speech, beam_size=1, word_timestamps=True, language="en")
    theirs = [w for s in segs for w in s.words]
    mine = [w for s in ours.segments for w in s.words]
    assert [w.word for w in mine] == [w.word for w in theirs]
    starts = [abs(a.start - b.start) for a, b in zip(mine, theirs, strict=True)]
    ends = [abs(a.end - b.end) for a, b in zip(mine, theirs, strict=True)]
    assert statistics.median(starts) <= MEDIAN_TOL and statistics.median(ends) <= MEDIAN_TOL
    assert max(starts + ends) <= MAX_TOL, (starts, ends)
    # probabilities agree loosely (fp32 on both sides, different kernels)
    probs = [abs(a.probability - b.probability) for a, b in zip(mine, theirs, strict=True)]
    assert statistics.median(probs) < 0.02
    duration = len(speech) / 16_000
    previous = 0.0
    for seg in ours.segments:
        assert seg.words and "".join(w.word for w in seg.words) == seg.text
        for w in seg.words:
            assert seg.start <= w.start <= w.end <= seg.end <= duration
            assert w.start >= previous and 0 < w.probability <= 1
            previous = w.end


def test_second_window_resumes_after_the_last_word_as_faster_whisper(whisper_tiny_en):
    # two sentences, 22 s of faint noise, two more: the first window ends mid-pause, so the
    # next one starts right after the last aligned word (openai-whisper's word-based seek)
    fw = pytest.importorskip("faster_whisper", reason="faster-whisper is the reference")
    pytest.importorskip("espeakng_loader", reason="espeakng-loader ships the espeak-ng library")

    def say(text: str) -> np.ndarray:
        audio, sr = clips.synthesize(text)
        return soxr.resample(audio, sr, 16_000).astype(np.float32)

    noise = np.random.default_rng(0).normal(0, 0.003, 16_000 * 22).astype(np.float32)
    audio = np.concatenate(
        [say(" ".join(clips.SENTENCES[1:3])), noise, say(" ".join(clips.SENTENCES[3:5]))]
    )
    greedy = DecodeOptions(word_timestamps=True, beam_size=1)  # as the reference's beam_size=1
    ours = transcribe(load_whisper(whisper_tiny_en), audio, greedy)
    model = fw.WhisperModel(str(whisper_tiny_en), device="cpu", compute_type="float32")
    theirs = list(model.transcribe(audio, beam_size=1, word_timestamps=True, language="en")[0])
    seeks = sorted({s.seek for s in ours.segments})
    assert len(seeks) == 2 and seeks[1] == round(ours.segments[1].words[-1].end * 100)
    # (after that window the two decoders may cut the remaining speech differently)
    assert seeks == sorted({s.seek for s in theirs})[:2]
    # segments both sides decoded alike: same words, boundaries within the tolerance
    pairs = [(a, b) for a in ours.segments for b in theirs if (a.seek, a.text) == (b.seek, b.text)]
    assert len(pairs) >= 2
    for a, b in pairs:
        assert [w.word for w in a.words] == [w.word for w in b.words]
        diffs = [
            abs(x.start - y.start) + abs(x.end - y.end)
            for x, y in zip(a.words, b.words, strict=True)
        ]
        assert max(diffs) <= MAX_TOL, diffs
    last = ours.segments[-1]
    assert last.start >= 5 and "".join(w.word for w in last.words) == last.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_word_timestamps_on_cuda_fp16_match_cpu(whisper_base, speech):
    cpu = transcribe(load_whisper(whisper_base), speech, DecodeOptions(word_timestamps=True))
    gpu_bundle = load_whisper(whisper_base, device="cuda", dtype=torch.float16)
    gpu = transcribe(gpu_bundle, speech, DecodeOptions(word_timestamps=True))
    a = [w for s in cpu.segments for w in s.words]
    b = [w for s in gpu.segments for w in s.words]
    assert [w.word for w in a] == [w.word for w in b]
    diffs = [abs(x.start - y.start) + abs(x.end - y.end) for x, y in zip(a, b, strict=True)]
    assert statistics.median(diffs) <= MEDIAN_TOL and max(diffs) <= MAX_TOL
