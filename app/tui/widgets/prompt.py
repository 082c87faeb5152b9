"""The chat input box. A paste that is only a model reference (a .gguf path, a Hub URL,
`org/repo:QUANT`) is handed to the app as a drop instead of being typed into the message; a paste
that is only an audio file's path asks for its transcript instead, and one that is only an image
file's path attaches the image to the next message."""

from pathlib import Path

from textual import events
from textual.message import Message
from textual.widgets import Input

from localllm.app.hub.spec import ModelSpec
from localllm.app.tui.drop import drop_audio, drop_spec
from localllm.app.tui.images import image_path


class ModelDropped(Message):
    """A model reference was pasted or dropped (the app imports or downloads it)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec


class AudioDropped(Message):
    """An audio file's path was pasted or dropped (the chat screen transcribes it)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path


class ImageDropped(Message):
    """An image file's path was pasted or dropped (the chat screen attaches it)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path


class PromptInput(Input):
    def _on_paste(self, event: events.Paste) -> None:
        # Textual calls each class's handler down the MRO; prevent_default skips Input's own
        # (which would type the text) and only for model references.
        spec = drop_spec(event.text) if not self.value.strip() else None
        if spec is not None:
            event.prevent_default()
            event.stop()
            self.post_message(ModelDropped(spec))
            return
        audio = drop_audio(event.text)  # also mid-message: the transcript joins the text
        if audio is not None:
            event.prevent_default()
            event.stop()
            self.post_message(AudioDropped(audio))
            return
        image = image_path(event.text)
        if image is not None:
            event.prevent_default()
            event.stop()
            self.post_message(ImageDropped(image))
