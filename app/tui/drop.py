"""Recognise a pasted or dropped model reference (a .gguf path, a Hub URL or `org/repo[:QUANT]`)
or audio file (to transcribe into the message).

Terminals deliver a drag-and-drop as a paste of the path (quoted, or with escaped spaces). Plain
chat text must not trigger a download, so a bare `org/repo` counts only when the repo name says
GGUF; anything else needs a quant tag or a Hub URL.
"""

from pathlib import Path

from localllm.app.hub.spec import ModelSpec, parse_spec

AUDIO_SUFFIXES = frozenset({".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3"})


def _unquote(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text.replace("\\ ", " ")


def drop_spec(text: str) -> ModelSpec | None:
    """The model `text` names when it is only a model reference, else None."""
    text = _unquote(text)
    if not text or "\n" in text or (" " in text and not text.lower().endswith(".gguf")):
        return None
    try:
        spec = parse_spec(text)
    except ValueError:
        return None
    if spec.kind == "path":
        ok = spec.path is not None and spec.path.is_file() and spec.path.suffix.lower() == ".gguf"
        return spec if ok else None
    if spec.kind != "hub":
        return None
    hosts = ("https:", "http:", "hf.co", "huggingface.co")
    is_url = text.split("/")[0].lower() in hosts
    if is_url or spec.quant or (spec.repo or "").lower().endswith("gguf"):
        return spec
    return None


def drop_audio(text: str) -> Path | None:
    """The audio file `text` names when it is only a path to an existing audio file, else None."""
    text = _unquote(text)
    if not text or "\n" in text:
        return None
    path = Path(text).expanduser()
    return path if path.suffix.lower() in AUDIO_SUFFIXES and path.is_file() else None
