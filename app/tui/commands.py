"""Command palette entries for the main actions (beside Textual's own: theme, keys, quit)."""

from collections.abc import Iterator

from textual.app import App, SystemCommand


def main_commands(app: App) -> Iterator[SystemCommand]:
    chat = app.chat
    yield SystemCommand("New chat", "Start a new conversation", chat.action_new_chat)
    yield SystemCommand("Models", "Library, Hub search and downloads", app.action_models)
    yield SystemCommand("Toggle light/dark", "Light or dark theme", app.action_toggle_theme)
    yield SystemCommand("Chat settings", "System prompt, temperature, top p", chat.action_sampling)
    yield SystemCommand("Regenerate", "Answer the last message again", chat.action_regenerate)
    yield SystemCommand("Edit last message", "Edit and resend it", chat.action_edit_last)
    yield SystemCommand("Stop", "Stop the answer being generated", chat.action_stop)
    yield SystemCommand("Copy answer", "Copy the last answer's code block", chat.action_copy_answer)
    yield SystemCommand("Rename conversation", "Give it a title", chat.action_rename)
    yield SystemCommand("Export conversation", "Write it as Markdown", chat.action_export)
    yield SystemCommand("Delete conversation", "Remove it from history", chat.action_delete)
    yield SystemCommand("Unload model", "Free the model's memory", app.unload_model)
    yield SystemCommand(
        "Attach audio", "Transcribe an audio file into the message", chat.action_attach
    )
    yield SystemCommand(
        "Attach image", "Send an image with the next message (/image PATH)",
        chat.action_attach_image,
    )  # fmt: skip
    yield SystemCommand(
        "Speak answer", "Read the last answer aloud (or save it as wav)", chat.action_speak
    )
