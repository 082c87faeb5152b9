"""Chat-screen speech actions: attach an audio file (its transcript goes into the message box,
not sent) and speak the last answer. Both run in thread workers; the status line shows progress.

A mixin of `ChatScreen` (which provides `history`, `conversation`, `refresh_status`).
"""

from pathlib import Path

from textual import work

from localllm.app.tui.history import slug
from localllm.app.tui.screens.modals import TextPromptModal
from localllm.app.tui.speech import speak, speakable, transcribe_file
from localllm.app.tui.widgets.prompt import AudioDropped, PromptInput


class SpeechActions:
    speech_state: str | None = None  # shown after the status line while speech work runs

    def action_attach(self) -> None:
        def done(path: str | None) -> None:
            if path:
                self.attach(path)

        self.app.push_screen(TextPromptModal("Transcribe an audio file into the message"), done)

    def on_audio_dropped(self, event: AudioDropped) -> None:
        event.stop()
        self.attach(event.path)

    def attach(self, path: str | Path) -> None:
        """Transcribe `path` in a worker; the text lands in the message box when done."""
        path = Path(str(path).strip().strip("'\"")).expanduser()
        if not path.is_file():
            self.notify(f"{path}: no such file", title="Cannot transcribe", severity="error")
            return
        self._transcribe(path)

    @work(thread=True, exclusive=True, group="transcribe")
    def _transcribe(self, path: Path) -> None:
        app = self.app

        def progress(fraction: float) -> None:
            app.call_from_thread(self._speech_status, f"transcribing {path.name} {fraction:.0%}")

        app.call_from_thread(self._speech_status, f"transcribing {path.name}…")
        try:
            text = transcribe_file(app.speech, path, progress)
        except Exception as e:  # not audio, no Whisper model, a broken model file
            app.call_from_thread(self._speech_failed, "Cannot transcribe", e)
            return
        app.call_from_thread(self._insert_transcript, text)

    def _insert_transcript(self, text: str) -> None:
        self._speech_status(None)
        if not text:
            self.notify("No speech found in the audio", severity="warning")
            return
        prompt = self.query_one(PromptInput)
        prompt.value = f"{prompt.value.rstrip()} {text}".strip()
        prompt.cursor_position = len(prompt.value)
        prompt.focus()
        self.notify("Transcript added to the message: edit it, then Enter sends", timeout=3)

    def action_speak(self) -> None:
        answers = [m for m in self.history if m.role == "assistant"]
        if not answers:
            self.notify("No answer to speak yet", severity="warning")
            return
        text = speakable(answers[-1].content)
        if not text:
            self.notify("The answer has no prose to speak (only code)", severity="warning")
            return
        title = self.conversation.title if self.conversation else "chat"
        self._speak(text, self.app.export_dir / f"{slug(title)}-reply-{answers[-1].id}.wav")

    @work(thread=True, exclusive=True, group="speak")
    def _speak(self, text: str, out: Path) -> None:
        app = self.app
        app.call_from_thread(self._speech_status, "speaking…")
        try:
            spoken = speak(app.speech, text, out, app.player)
        except Exception as e:  # no voice installed, a broken voice file
            app.call_from_thread(self._speech_failed, "Cannot speak", e)
            return
        app.call_from_thread(self._speech_status, None)
        if spoken.played:
            app.call_from_thread(self.notify, f"Spoke the answer ({spoken.seconds:.1f} s)")
        else:
            note = f"No audio output: saved the spoken answer to {spoken.path}"
            app.call_from_thread(self.notify, note, timeout=6)

    def _speech_status(self, state: str | None) -> None:
        self.speech_state = state
        self.refresh_status()

    def _speech_failed(self, title: str, error: Exception) -> None:
        self._speech_status(None)
        self.notify(str(error) or type(error).__name__, title=title, severity="error", timeout=6)
