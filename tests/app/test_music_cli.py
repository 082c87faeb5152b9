"""`localllm music`: greedy runs write what transformers' codes decode to (wav), stereo and
compressed formats, a melody file and a continued clip, progress in seconds of audio on
stderr, seeded runs reproducible; bad input exits 1 with one `localllm: error:` line."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf
import torch

from localllm.app.cli import main
from tests.media.music.music_fixture import CLIP_WAV, DATA, MELODY_WAV, expected, model

# one thread: the tiny model's ops are small, and two threads on a shared 2-core machine make
# every op wait on the other core's load
THREADS = ["-t", "1", "--dtype", "float32"]  # float32: the precision transformers ran in
SECONDS = str(expected()["frames"] / 50)


def _run(*argv: str) -> int:
    return main(["music", *argv, *THREADS])


def _pcm16(codes_name: str, name: str) -> np.ndarray:
    """What our decode of transformers' codes is once written as 16-bit PCM (libsndfile
    scales by 32768, we by 32767: hence the tests' tolerance of 2)."""
    m = model(name)
    wave = m.decode(torch.tensor(expected()["cases"][codes_name]["codes"]))
    return np.round(np.clip(wave, -1, 1) * 32767).astype(np.int16)


def test_greedy_wav_is_transformers_codes_decoded(tmp_path, capsys):
    out = tmp_path / "g.wav"
    assert _run(expected()["prompt"], "-m", str(DATA / "musicgen"), "-d", SECONDS,
                "--temperature", "0", "-o", str(out), "-v") == 0  # fmt: skip
    audio, rate = sf.read(out, dtype="int16")
    assert rate == 32000
    np.testing.assert_allclose(audio, _pcm16("greedy_cfg3", "musicgen")[0], atol=2)
    err = capsys.readouterr().err
    assert f"{float(SECONDS):.1f}/{float(SECONDS):.1f} s" in err and "RTF" in err


def test_melody_and_continue(tmp_path):
    out = tmp_path / "m.wav"
    assert _run(expected()["prompt"], "-m", str(DATA / "musicgen-melody"), "-d", SECONDS,
                "--temperature", "0", "--melody", str(MELODY_WAV), "-o", str(out)) == 0  # fmt: skip
    audio, _ = sf.read(out, dtype="int16")
    np.testing.assert_allclose(audio, _pcm16("melody_cfg3", "musicgen-melody")[0], atol=2)
    case = expected()["cases"]["stereo_continue_cfg3"]
    seconds = str((expected()["frames"] + case["prompt_frames"]) / 50)
    out = tmp_path / "c.wav"
    assert _run(expected()["prompt"], "-m", str(DATA / "musicgen-stereo"), "-d", seconds,
                "--temperature", "0", "--continue", str(CLIP_WAV), "-o", str(out)) == 0  # fmt: skip
    audio, _ = sf.read(out, dtype="int16")
    assert audio.shape[1] == 2
    np.testing.assert_allclose(audio.T, _pcm16("stereo_continue_cfg3", "musicgen-stereo"), atol=2)


def test_formats_and_seeded_reproducibility(tmp_path):
    a, b, c = tmp_path / "a.mp3", tmp_path / "b.mp3", tmp_path / "c.flac"
    base = ["synth pop", "-m", str(DATA / "musicgen-stereo"), "-d", "0.3"]
    assert _run(*base, "--seed", "5", "-o", str(a)) == 0
    assert _run(*base, "--seed", "5", "-o", str(b)) == 0
    assert a.read_bytes() == b.read_bytes()
    assert sf.info(a).format == "MP3" and sf.info(a).channels == 2
    assert _run(*base, "--seed", "6", "-o", str(c), "--top-p", "0.9", "--top-k", "0") == 0
    info = sf.info(c)
    assert info.format == "FLAC" and info.channels == 2 and info.frames == 0.3 * 32000


@pytest.mark.parametrize(
    "argv,message",
    [
        (["", "-m", "{musicgen}"], "the prompt is empty"),
        (["a", "-m", "{musicgen}", "-d", "0"], "duration must be > 0 and <= 300 seconds"),
        (["a", "-m", "{musicgen}", "-d", "600"], "duration must be > 0 and <= 300 seconds"),
        (["a", "-m", "{melody}", "--melody", "{notaudio}"], "not a readable audio file"),
        (["a", "-m", "{melody}", "--melody", "{missing}"], "--melody: "),
        (["a", "-m", "{musicgen}", "--melody", "{melody_wav}"], "is not a melody model"),
        (["a", "-m", "{musicgen}", "--continue", "{notaudio}"], "not a readable audio file"),
        (["a", "-m", "{musicgen}", "-d", "0.05", "--continue", "{clip}"], "longer than the clip"),
        (["a", "-m", "{musicgen}", "--top-p", "0"], "--top-p must be in (0, 1]"),
        (["a", "-m", "{musicgen}", "--temperature", "-1"], "temperature must be between"),
        (["a", "-m", "{notaudio}"], "not a MusicGen folder"),
        (["a", "-m", "{tmp}"], "config.json"),
        (["a", "-m", "{musicgen}", "-o", "{tmp}/x.aac"], "aac output is not supported"),
    ],
)
def test_bad_input_is_one_error_line(tmp_path, capsys, argv, message):
    (tmp_path / "notes.txt").write_text("not audio")
    names = {"musicgen": DATA / "musicgen", "melody": DATA / "musicgen-melody",
             "notaudio": tmp_path / "notes.txt", "missing": tmp_path / "nope.wav",
             "melody_wav": MELODY_WAV, "clip": CLIP_WAV, "tmp": tmp_path}  # fmt: skip
    argv = [a.format(**names) for a in argv]
    if "-o" not in argv:
        argv += ["-o", str(tmp_path / "out.wav")]
    assert _run(*argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("localllm: error: "), err
    assert message.replace("-p must", "") in err[0].replace("-p must", ""), err[0]
    assert not (tmp_path / "out.wav").exists()


def test_default_model_not_downloaded_says_how_to_pull(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("LOCALLLM_YES", raising=False)
    monkeypatch.setattr("sys.stdin", None)
    assert _run("a", "-o", str(tmp_path / "x.wav")) == 1
    err = capsys.readouterr().err
    assert "localllm pull facebook/musicgen-small" in err


def test_music_dtype_choice(monkeypatch):
    from localllm.app.music import music_dtype

    assert music_dtype("float32", "cpu") == torch.float32
    assert music_dtype("auto", "cuda") == torch.float32
    monkeypatch.setenv("LOCALLLM_MUSIC_DTYPE", "bfloat16")
    assert music_dtype(None, "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="--dtype must be one of"):
        music_dtype("int8", "cpu")
