"""The TUI's `/music [SECONDS s] PROMPT`: generates with the tiny recorded MusicGen in a worker,
the status line counts seconds of audio, the wav lands in the export folder (played when a
player works), nothing is sent to the chat model; failures are notices."""

import numpy as np
import pytest
import soundfile as sf

from localllm.app.tui.screens.chat_music import parse_music_command
from localllm.app.tui.widgets.prompt import PromptInput
from tests.app.tui.fakes import FakeBackend, make_app, wait_for
from tests.media.music.music_fixture import DATA

pytestmark = pytest.mark.anyio
SLOW = 3000


def test_parse_music_command():
    assert parse_music_command("/music 15s lo-fi piano") == (15.0, "lo-fi piano")
    assert parse_music_command("/music 0.5 s drums") == (0.5, "drums")
    assert parse_music_command("/music jazz at 5s") == (10.0, "jazz at 5s")
    assert parse_music_command("/music") == (10.0, "")


def _notes(app) -> list[str]:
    return [f"{n.title}: {n.message}" for n in app._notifications]


async def test_music_command_saves_and_plays(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALLLM_MUSIC_MODEL", str(DATA / "musicgen-stereo"))
    played = []
    backend = FakeBackend(["unused"])
    app = make_app(tmp_path, backend, player=lambda s, r: played.append((s, r)) or True)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.backend is not None)
        chat = app.screen
        states = []
        show = chat._speech_status
        chat._speech_status = lambda state: (states.append(state), show(state))
        chat.query_one(PromptInput).value = "/music 0.3s synth pop"
        await pilot.press("enter")
        await wait_for(pilot, lambda: any("of music" in n for n in _notes(app)), limit=SLOW)
        assert "music 0.3/0.3 s" in states and states[-1] is None
        assert not backend.calls and not chat.history
    (out,) = tmp_path.glob("music-*.wav")
    audio, rate = sf.read(out, dtype="float32")
    assert rate == 32000 and audio.shape == (9600,)  # the stereo mixed down to mono
    assert played and played[0][1] == 32000 and np.isfinite(played[0][0]).all()
    assert any("Played and saved 0.3 s of music" in n for n in _notes(app))


async def test_music_failures_are_notices(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALLLM_MUSIC_MODEL", str(tmp_path / "no-such-model"))
    app = make_app(tmp_path, FakeBackend(["unused"]))
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.backend is not None)
        prompt = app.screen.query_one(PromptInput)
        prompt.value = "/music"
        await pilot.press("enter")
        await wait_for(pilot, lambda: any("Say what to make" in n for n in _notes(app)))
        prompt.value = "/music 2s piano"
        await pilot.press("enter")
        await wait_for(pilot, lambda: any("Cannot make music" in n for n in _notes(app)), SLOW)
        assert app.is_running and app.screen.speech_state is None
