"""`localllm music "PROMPT"`: text (and a melody, or a clip to continue) to music with MusicGen,
written as wav/flac/mp3/ogg/opus/pcm, with a progress bar in seconds of audio on stderr.

Also the one place that turns `-m` into a MusicGen folder (a path, or a Hugging Face repo id
found in the cache: `localllm pull facebook/musicgen-small`) and checks a request's values before
any model loads; the server and the TUI reuse both.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from localllm.media.music import MusicGen, SamplingOptions

DEFAULT_MODEL = "facebook/musicgen-small"
DEFAULT_SECONDS = 10.0
MODEL_ENV = "LOCALLLM_MUSIC_MODEL"
DTYPE_ENV = "LOCALLLM_MUSIC_DTYPE"
DTYPES = ("auto", "float32", "bfloat16", "float16")


def default_music_model() -> str:
    """$LOCALLLM_MUSIC_MODEL, else facebook/musicgen-small."""
    return os.environ.get(MODEL_ENV) or DEFAULT_MODEL


def add_parser(sub) -> None:
    p = sub.add_parser("music", help="text to music (MusicGen) into an audio file")
    p.add_argument("prompt", help="what the music should be, e.g. '80s pop with synths'")
    p.add_argument(
        "-m",
        "--model",
        help=f"MusicGen folder or Hugging Face repo (default ${MODEL_ENV}, else {DEFAULT_MODEL})",
    )
    p.add_argument(
        "-d",
        "--duration",
        type=float,
        default=DEFAULT_SECONDS,
        help=f"seconds of music (default {DEFAULT_SECONDS:g}; with --continue, the clip included)",
    )
    p.add_argument("-o", "--output", help="output file, '-' for stdout (format from the suffix)")
    p.add_argument("--format", help="wav, flac, mp3, opus, ogg or pcm (s16le); overrides suffix")
    p.add_argument("--seed", type=int, default=None, help="sampling seed for reproducible music")
    p.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="sampling temperature, 0 = greedy (default 1)",
    )
    p.add_argument(
        "--top-k", type=int, default=250, help="sample from the top K codes, 0 = off (default 250)"
    )
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling, 1 = off (default 1)")
    p.add_argument(
        "--guidance-scale",
        type=float,
        default=3.0,
        help="classifier-free guidance, <= 1 = off (default 3)",
    )
    p.add_argument(
        "--melody",
        metavar="FILE",
        help="audio whose melody (chroma) conditions a musicgen-melody model",
    )
    p.add_argument(
        "--continue",
        dest="continue_",
        metavar="FILE",
        help="audio clip the music starts with and continues",
    )
    p.add_argument(
        "-t", "--threads", type=int, default=None, help="CPU threads (default: torch's choice)"
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the model runs (auto: cuda when available)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help=f"the LM's precision (default ${DTYPE_ENV}, else auto: bfloat16 on CPUs with "
        "native bf16, float32 otherwise)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="timings to stderr")
    p.set_defaults(handler=handle)  # fmt: skip


def music_dtype(choice: str | None, device: str):
    """The LM's torch dtype for `--dtype` (else $LOCALLLM_MUSIC_DTYPE, else auto). auto:
    bfloat16 on a CPU that computes it natively (AVX512-BF16 or AMX: the step reads half the
    bytes), float32 elsewhere (CUDA included, until half precision is measured there)."""
    import torch

    choice = choice or os.environ.get(DTYPE_ENV) or "auto"
    if choice not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {choice!r}")
    if choice != "auto":
        return getattr(torch, choice)
    native = [getattr(torch.cpu, f, lambda: False)() for f in
              ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]  # fmt: skip
    return torch.bfloat16 if device == "cpu" and any(native) else torch.float32


def load_music_model(name: str | None, device: str = "auto", dtype: str | None = None):
    """The MusicGen `name` names, on `device` (auto: CUDA when available) in `dtype`."""
    from localllm.media.music import MusicGen

    device = _device(device)
    return MusicGen(resolve_music_model(name), device=device, dtype=music_dtype(dtype, device))


def resolve_music_model(name: str | None) -> Path:
    """The MusicGen folder `name` names (a path or a cached Hub repo); errors say how to get it."""
    from localllm.app.model_path import resolve_model_path

    name = name or default_music_model()
    path = resolve_model_path(name)
    if not path.is_dir():
        raise ValueError(f"{name}: not a MusicGen folder (config.json + safetensors)")
    return path


def sampling_options(temperature, top_k, top_p, guidance_scale, seed) -> SamplingOptions:
    """Checked options (ValueError naming the field)."""
    from localllm.media.music import SamplingOptions

    opts = SamplingOptions(temperature=temperature, top_k=top_k, top_p=top_p,
                           guidance_scale=guidance_scale, seed=seed)  # fmt: skip
    opts.check()
    return opts


@dataclass
class Inputs:
    """A request's audio inputs, decoded at the model's rate before generation starts."""

    melody: object = None  # mono float32 array
    continuation: object = None  # (channels, samples) float32 array


def read_inputs(model: MusicGen, melody: str | bytes | None, clip: str | bytes | None) -> Inputs:
    from localllm.media.audio import load_audio
    from localllm.media.music.clip import load_clip

    if melody is not None and not model.config.melody:
        raise ValueError(f"{model.name} is not a melody model: --melody needs a musicgen-melody "
                         "model (e.g. -m facebook/musicgen-melody)")  # fmt: skip
    return Inputs(
        load_audio(melody, model.sample_rate) if melody is not None else None,
        load_clip(clip, model.sample_rate, model.channels) if clip is not None else None,
    )


class ProgressBar:
    """`music: [#####.....] 4.2/10.0 s` on stderr: redrawn in place on a terminal, a line per
    quarter otherwise (logs)."""

    def __init__(self, stream=None, width: int = 30):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.width, self.last, self.t0 = width, -1.0, time.perf_counter()

    def __call__(self, done: float, total: float) -> None:
        frac = done / total if total else 1.0
        step = 0.01 if self.tty else 0.25
        if frac < 1 and frac - self.last < step:
            return
        self.last = frac
        bar = "#" * round(frac * self.width)
        rate = done / max(time.perf_counter() - self.t0, 1e-9)
        line = f"music: [{bar:<{self.width}}] {done:.1f}/{total:.1f} s ({rate:.2f} s/s)"
        end = ("\n" if frac >= 1 else "") if self.tty else "\n"
        self.stream.write(("\r" + line if self.tty else line) + end)
        self.stream.flush()


def handle(args: argparse.Namespace) -> int:
    from localllm.media.audio.encode import format_for_path
    from localllm.media.music import check_seconds
    from localllm.media.music.clip import encode_music

    if not args.prompt.strip():
        raise ValueError("the prompt is empty: describe the music to make")
    check_seconds(args.duration)
    opts = sampling_options(args.temperature, args.top_k, args.top_p, args.guidance_scale,
                            args.seed)  # fmt: skip
    out = args.output
    if out is None:
        if sys.stdout.isatty():
            raise ValueError("give an output file with -o (or '-o -' to write audio to stdout)")
        out = "-"
    fmt = format_for_path("x.wav" if out == "-" and not args.format else out, args.format)
    for flag, path in (("--melody", args.melody), ("--continue", args.continue_)):
        if path is not None and not Path(path).is_file():
            raise ValueError(f"{flag}: {path}: no such audio file")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError("--threads must be at least 1")
        import torch

        torch.set_num_threads(args.threads)
    music_dtype(args.dtype, "cpu")  # a bad --dtype fails before the model loads
    t0 = time.perf_counter()
    model = load_music_model(args.model, args.device, args.dtype)
    inputs = read_inputs(model, args.melody, args.continue_)
    t_load = time.perf_counter() - t0
    t1 = time.perf_counter()
    music = model.generate(args.prompt, args.duration, opts, inputs.melody, inputs.continuation,
                           ProgressBar())  # fmt: skip
    elapsed = time.perf_counter() - t1
    data = encode_music(music.samples, music.sample_rate, fmt)
    if out == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
    else:
        Path(out).write_bytes(data)
    if args.verbose:
        print(f"localllm: {model.name} loaded in {t_load:.2f}s; {music.seconds:.2f}s of music in "
              f"{elapsed:.2f}s (RTF {elapsed / music.seconds:.2f})", file=sys.stderr)  # fmt: skip
    return 0


def _device(choice: str) -> str:
    import torch

    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: this torch sees no CUDA device")
    if choice != "auto":
        return choice
    return "cuda" if torch.cuda.is_available() else "cpu"
