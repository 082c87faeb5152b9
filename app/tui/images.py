"""Images attached to a chat message in the TUI.

An attached image is kept in the message's text as one `[image: PATH]` line at its start, so the
history store keeps it with the message, and the transcript shows it as a chip (and a small
preview: `widgets/image_preview`). When the message is sent, the image's bytes are copied into
the history's image folder under their SHA-256 (`keep_image`: `images/<hash>/<file name>` beside
the history database), and PATH is that copy: a conversation answered again after the original
file moved or was deleted still has its image; deleting a conversation deletes the copies no
other message names (`prune_kept`). Before a backend sees the conversation, those lines become
content parts: `{"type": "image", "path": PATH}` then the text. A dropped or pasted path with an
image suffix attaches that image.
"""

import base64
import hashlib
import os
import re
import shutil
import time
from pathlib import Path

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff"})
MAX_IMAGES = 8  # attached to one message (documented in docs/tui.md)
MAX_IMAGE_BYTES = 20 * 1024 * 1024  # one attached file, as the server's limit (docs/tui.md)
PRUNE_GRACE_S = 60.0  # a kept copy this new is spared by `prune_kept` (its message is on the way)
_LINE = re.compile(r"\[image: (.+)\]")


def with_images(text: str, paths: list[Path]) -> str:
    """The message text with `paths` attached in front."""
    return "".join(f"[image: {p}]\n" for p in paths) + text


def split_images(content: str) -> tuple[list[Path], str]:
    """(the attached image paths, the rest of the text) of a stored message."""
    paths, lines = [], content.split("\n")
    while lines and (m := _LINE.fullmatch(lines[0])):
        paths.append(Path(m.group(1)))
        lines.pop(0)
    return paths, "\n".join(lines)


def chips(content: str) -> str:
    """The message as the transcript shows it: each image as a chip line with its file name."""
    paths, text = split_images(content)
    if not paths:
        return content
    return "".join(f"🖼 `{p.name}`  \n" for p in paths) + "\n" + text


def parts(messages: list[dict]) -> list[dict]:
    """Chat messages with each attached image as an `{"type": "image", "path": ...}` part."""
    out = []
    for m in messages:
        paths, text = split_images(m["content"]) if m.get("role") == "user" else ([], "")
        if not paths:
            out.append(m)
            continue
        content = [{"type": "image", "path": str(p)} for p in paths]
        out.append({**m, "content": [*content, {"type": "text", "text": text}]})
    return out


def image_path(text: str) -> Path | None:
    """The image file `text` names when it is only a path to an existing image, else None."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    text = text.replace("\\ ", " ")
    if not text or "\n" in text:
        return None
    path = Path(text).expanduser()
    return path.resolve() if path.suffix.lower() in IMAGE_SUFFIXES and path.is_file() else None


def keep_image(path: Path, folder: Path) -> Path:
    """The history's copy of the image at `path` (`folder/<sha256>/<name>`, written once); a
    file that cannot be read or is too large is a one-line ValueError. Blocking: off the loop."""
    try:
        size = path.stat().st_size  # before reading: a huge file is never read whole
    except OSError as e:
        raise ValueError(f"cannot read the attached image {path}: {e.strerror or e}") from None
    if size > MAX_IMAGE_BYTES:
        raise ValueError(f"{path.name} is {size} bytes, above the {MAX_IMAGE_BYTES} allowed")
    data = read_image(path)
    kept = folder / hashlib.sha256(data).hexdigest() / path.name
    if not kept.is_file():
        kept.parent.mkdir(parents=True, exist_ok=True)
        part = kept.with_name(kept.name + ".part")
        part.write_bytes(data)
        os.replace(part, kept)  # whole or absent, never a torn copy
    return kept


def prune_kept(store, folder: Path, grace: float = PRUNE_GRACE_S) -> int:
    """Delete the kept copies that no message of `store` names any more (after a conversation
    is deleted), sparing those written in the last `grace` seconds (a message being sent);
    returns how many. Blocking: off the loop."""
    if not folder.is_dir():
        return 0
    used = set()
    for conv in store.conversations("[image: "):
        for m in store.messages(conv.id):
            paths = split_images(m.content)[0]
            used.update(p.parent.name for p in paths if p.parent.parent == folder)
    now, gone = time.time(), 0
    for d in folder.iterdir():
        if d.is_dir() and d.name not in used and now - d.stat().st_mtime > grace:
            shutil.rmtree(d, ignore_errors=True)
            gone += 1
    return gone


def read_image(path: str | Path) -> bytes:
    """The attached file's bytes; OSError as a one-line ValueError."""
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the attached image {path}: {e.strerror or e}") from None


_MIME = {".jpg": "jpeg", ".jpeg": "jpeg", ".tif": "tiff"}


def openai_messages(messages: list[dict]) -> list[dict]:
    """`parts(messages)` in the OpenAI chat shape: each image as an `image_url` data URL (reads
    the files: call it off the event loop)."""
    out = []
    for m in parts(messages):
        if isinstance(m["content"], list):
            content = []
            for p in m["content"]:
                if p["type"] == "image":
                    mime = _MIME.get(Path(p["path"]).suffix.lower(), Path(p["path"]).suffix[1:])
                    data = base64.b64encode(read_image(p["path"])).decode()
                    p = {
                        "type": "image_url",
                        "image_url": {"url": f"data:image/{mime};base64,{data}"},
                    }
                content.append(p)
            m = {**m, "content": content}
        out.append(m)
    return out
