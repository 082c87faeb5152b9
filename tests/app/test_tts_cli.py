"""`localllm tts`: text (argument or stdin) to a file whose format follows the suffix or
--format, or to stdout; user errors exit 1 with one clear line."""

import io
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf

from localllm.app.cli import main
from tests.media.tts_fixtures import voice_path

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _needs_voice():
    voice_path()


def test_text_to_wav_file(tmp_path, capsys) -> None:
    out = tmp_path / "hello.wav"
    # one thread in both runs: without -t the count follows the machine's load at start, and
    # another count sums the vocoder's floats in another order (one sample's last bit seen)
    args = ["tts", "Hello there. How are you?", "--seed", "1", "-t", "1"]
    assert main([*args, "-o", str(out), "-v"]) == 0
    audio, rate = sf.read(out, dtype="float32")
    assert rate == 22050 and sf.info(out).format == "WAV"
    assert 0.8 < len(audio) / rate < 4.0 and 0.02 < np.abs(audio).max() < 0.99
    err = capsys.readouterr().err
    assert "RTF" in err and "first audio after" in err
    # the same seed (and threads) gives the same file
    again = tmp_path / "again.wav"
    assert main([*args, "-o", str(again)]) == 0
    assert again.read_bytes() == out.read_bytes()


def test_format_from_suffix_and_override(tmp_path) -> None:
    mp3 = tmp_path / "a.mp3"
    assert main(["tts", "Short test.", "-o", str(mp3), "--seed", "2"]) == 0
    assert sf.info(mp3).format == "MP3"
    other = tmp_path / "a.bin"
    assert main(["tts", "Short test.", "-o", str(other), "--format", "flac", "--seed", "2"]) == 0
    assert sf.info(other).format == "FLAC"


def test_speed_changes_duration(tmp_path) -> None:
    slow, fast = tmp_path / "slow.wav", tmp_path / "fast.wav"
    text = "Counting one two three four five."
    assert main(["tts", text, "-o", str(slow), "--seed", "3"]) == 0
    assert main(["tts", text, "-o", str(fast), "--seed", "3", "--speed", "1.5"]) == 0
    ratio = sf.info(fast).frames / sf.info(slow).frames
    assert 0.55 < ratio < 0.8


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["   ", "-o", "x.wav"], "no text to speak"),
        (["hi", "-o", "x.aac"], "no AAC encoder"),
        (["hi", "-o", "x.xyz"], "unknown audio format"),
        (["hi", "-o", "x.wav", "--speed", "9"], "speed must be between"),
        (["hi", "-o", "x.wav", "--voice", "bob"], "unknown voice 'bob'"),
        (["hi", "-o", "x.wav", "-m", "/nonexistent/v.onnx"], "no voice file"),
    ],
)
def test_user_errors_exit_1(argv, message, capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["tts", *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("localllm: error:") and message in err
    assert not (tmp_path / "x.wav").exists()


def test_stdin_text_to_stdout_stream() -> None:
    cmd = [sys.executable, "-m", "localllm.app", "tts", "-o", "-", "--format", "wav", "--seed", "4"]
    proc = subprocess.run(cmd, input=b"Piped text.", capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr.decode()
    audio, rate = sf.read(io.BytesIO(proc.stdout), dtype="float32")
    assert rate == 22050 and 0.4 < len(audio) / rate < 3.0 and np.abs(audio).max() > 0.02
