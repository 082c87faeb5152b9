"""Transcript writers: plain text, SubRip (srt), WebVTT and JSON (OpenAI verbose_json shape).

Subtitles are one cue per segment, or, when the transcript has word timestamps and a word limit
is given, cues of at most that many words timed by their first and last word.
"""

import json
from dataclasses import asdict

from localllm.media.stt.transcribe import Transcript

FORMATS = ("text", "srt", "vtt", "json")


def _stamp(seconds: float, sep: str) -> str:
    ms = max(0, round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def to_text(t: Transcript) -> str:
    return t.text + "\n" if t.text else ""


def cues(t: Transcript, max_words: int | None = None) -> list[tuple[float, float, str]]:
    """(start, end, text) subtitle cues: segments, split by word when `max_words` is set."""
    if max_words is not None and max_words < 1:
        raise ValueError("the words-per-line limit must be at least 1")
    out = []
    for s in t.segments:
        if max_words is None or not s.words:
            out.append((s.start, s.end, s.text.strip()))
            continue
        for i in range(0, len(s.words), max_words):
            line = s.words[i : i + max_words]
            out.append((line[0].start, line[-1].end, "".join(w.word for w in line).strip()))
    return out


def to_srt(t: Transcript, max_words: int | None = None) -> str:
    blocks = [
        f"{i}\n{_stamp(start, ',')} --> {_stamp(end, ',')}\n{text}\n"
        for i, (start, end, text) in enumerate(cues(t, max_words), 1)
    ]
    return "\n".join(blocks)


def to_vtt(t: Transcript, max_words: int | None = None) -> str:
    blocks = [
        f"{_stamp(start, '.')} --> {_stamp(end, '.')}\n{text}\n"
        for start, end, text in cues(t, max_words)
    ]
    return "\n".join(["WEBVTT\n", *blocks])


def to_dict(t: Transcript, task: str = "transcribe") -> dict:
    """OpenAI's verbose_json body: task, language, duration, text, segments (with seek/tokens);
    with word timestamps, each segment's `words` and OpenAI's top-level `words` list."""
    segments = []
    for s in t.segments:
        d = asdict(s)
        d["tokens"] = list(s.tokens)
        d["words"] = [asdict(w) for w in s.words]
        if not s.words:
            del d["words"]
        segments.append(d)
    body = {
        "task": task,
        "language": t.language,
        "duration": round(t.duration, 3),
        "text": t.text,
        "segments": segments,
    }
    if any(s.words for s in t.segments):
        body["words"] = [
            {"word": w.word.strip(), "start": w.start, "end": w.end}
            for s in t.segments
            for w in s.words
        ]
    return body


def render(t: Transcript, fmt: str, task: str = "transcribe", max_words: int | None = None) -> str:
    """The transcript in one of FORMATS (`max_words`: words per subtitle cue, srt/vtt only)."""
    if fmt == "text":
        return to_text(t)
    if fmt == "srt":
        return to_srt(t, max_words)
    if fmt == "vtt":
        return to_vtt(t, max_words)
    if fmt == "json":
        return json.dumps(to_dict(t, task), ensure_ascii=False, indent=2) + "\n"
    raise ValueError(f"unknown format {fmt!r} (choose from {', '.join(FORMATS)})")
