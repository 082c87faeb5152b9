"""Transcript writers: plain text, SubRip (srt), WebVTT and JSON (OpenAI verbose_json shape)."""

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


def to_srt(t: Transcript) -> str:
    blocks = [
        f"{i}\n{_stamp(s.start, ',')} --> {_stamp(s.end, ',')}\n{s.text.strip()}\n"
        for i, s in enumerate(t.segments, 1)
    ]
    return "\n".join(blocks)


def to_vtt(t: Transcript) -> str:
    blocks = [
        f"{_stamp(s.start, '.')} --> {_stamp(s.end, '.')}\n{s.text.strip()}\n" for s in t.segments
    ]
    return "\n".join(["WEBVTT\n", *blocks])


def to_dict(t: Transcript, task: str = "transcribe") -> dict:
    """OpenAI's verbose_json body: task, language, duration, text, segments (with seek/tokens)."""
    segments = []
    for s in t.segments:
        d = asdict(s)
        d["tokens"] = list(s.tokens)
        segments.append(d)
    return {
        "task": task,
        "language": t.language,
        "duration": round(t.duration, 3),
        "text": t.text,
        "segments": segments,
    }


def render(t: Transcript, fmt: str, task: str = "transcribe") -> str:
    """The transcript in one of FORMATS."""
    if fmt == "text":
        return to_text(t)
    if fmt == "srt":
        return to_srt(t)
    if fmt == "vtt":
        return to_vtt(t)
    if fmt == "json":
        return json.dumps(to_dict(t, task), ensure_ascii=False, indent=2) + "\n"
    raise ValueError(f"unknown format {fmt!r} (choose from {', '.join(FORMATS)})")
