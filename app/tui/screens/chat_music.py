"""Chat-screen music: `/music [SECONDS s] PROMPT` makes music with MusicGen in a thread
worker (the status line shows the seconds of audio made so far), plays it when an output
device works, and always saves it as a wav in the export folder.

The model is `$LOCALLLM_MUSIC_MODEL` or facebook/musicgen-small (pulled with `localllm pull`),
loaded on first use and kept on the app. A mixin of `ChatScreen`.
"""

import re
from pathlib import Path

from textual import work

from localllm.app.tui.history import slug

DEFAULT_SECONDS = 10.0
_LEADING_SECONDS = re.compile(r"^(\d+(?:\.\d+)?)\s*s\s+(.*)$", re.S)


def parse_music_command(text: str) -> tuple[float, str]:
    """`/music 15s lo-fi piano` -> (15.0, "lo-fi piano"); no length given: 10 s."""
    rest = text.removeprefix("/music").strip()
    m = _LEADING_SECONDS.match(rest)
    return (float(m[1]), m[2].strip()) if m else (DEFAULT_SECONDS, rest)


class MusicActions:
    def make_music(self, text: str) -> None:
        seconds, prompt = parse_music_command(text)
        if not prompt:
            self.notify("Say what to make: /music [SECONDS s] PROMPT", severity="warning")
            return
        out = self.app.export_dir / f"music-{slug(prompt[:40])}.wav"
        self._music(prompt, seconds, out)

    @work(thread=True, exclusive=True, group="music")
    def _music(self, prompt: str, seconds: float, out: Path) -> None:
        from localllm.media.audio.encode import encode

        app = self.app

        shown = [""]

        def progress(done: float, total: float) -> None:
            state = f"music {done:.1f}/{total:.1f} s"
            if state != shown[0]:  # a redraw per tenth of a second of audio, not per step
                shown[0] = state
                app.call_from_thread(self._speech_status, state)

        app.call_from_thread(self._speech_status, "music: loading the model…")
        try:
            model = self._music_model()
            music = model.generate(prompt, seconds, self._music_options(), progress=progress)
        except Exception as e:  # no model pulled, bad duration, a broken folder
            app.call_from_thread(self._speech_failed, "Cannot make music", e)
            return
        out.parent.mkdir(parents=True, exist_ok=True)
        mono = music.samples.mean(axis=0)
        out.write_bytes(encode(mono, music.sample_rate, "wav"))
        app.call_from_thread(self._speech_status, None)
        played = app.player(mono, music.sample_rate)
        note = f"{'Played and saved' if played else 'Saved'} {music.seconds:.1f} s of music: {out}"
        app.call_from_thread(self.notify, note, timeout=6)

    def _music_model(self):
        app = self.app
        model = getattr(app, "music_model", None)
        if model is None:
            from localllm.app.music import load_music_model

            model = app.music_model = load_music_model(None)
        return model

    @staticmethod
    def _music_options():
        from localllm.media.music import SamplingOptions

        return SamplingOptions()  # MusicGen's own defaults: top-k 250, guidance 3
