"""Images of chat requests: which engine can see, where an image URL's bytes come from, limits.

An engine sees when `serve` attached a `VisionPipeline` to it (`attach_vision`; its mmproj).
Image URLs are read here, on the event loop but never blocking it: `data:` URLs are decoded,
`http(s)` URLs fetched with a byte cap and a deadline, `file:` URLs read only under the
`--allowed-local-media-path` folder. Decoding and preprocessing then run in a worker thread.
Every refusal is an `APIError` 400 with one line that says why.
"""

import asyncio
import base64
import binascii
import weakref
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import httpx

from localllm.app.server.errors import APIError

_VISION: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
MEDIA = ("image", "video")  # the content part types a vision pipeline takes


def attach_vision(engine: Any, pipeline: Any) -> None:
    """Let `engine` (an `AsyncEngine`) take images through `pipeline` (a `VisionPipeline`)."""
    _VISION[engine.engine] = pipeline


def vision_of(engine: Any) -> Any:
    """The pipeline attached to `engine` (or a router handle of it), or None: text only."""
    inner = getattr(engine, "engine", None)
    return _VISION.get(inner) if inner is not None else None


def take_images(messages: list[dict]) -> tuple[list[dict], list[str]]:
    """(messages with each image or video part reduced to `{"type": "image"}` or
    `{"type": "video"}`, their URLs in order; `media_kinds` says which is which)."""
    urls: list[str] = []
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list) and any(p.get("type") in MEDIA for p in content):
            parts = []
            for p in content:
                if p.get("type") in MEDIA:
                    urls.append(p["url"])
                    p = {"type": p["type"]}
                parts.append(p)
            m = {**m, "content": parts}
        out.append(m)
    return out, urls


def media_kinds(messages: list[dict]) -> list[str]:
    """ "image" or "video" for each media part of `take_images`' messages, in order."""
    return [
        p["type"]
        for m in messages
        if isinstance(m.get("content"), list)
        for p in m["content"]
        if p.get("type") in MEDIA
    ]


async def load_image(url: str, settings: Any, cap: int | None = None) -> bytes:
    """The bytes behind one image URL (or a video's, with its `cap`), within the limits."""
    cap = settings.max_image_bytes if cap is None else cap
    scheme = urlparse(url).scheme.lower() if ":" in url[:16] else ""
    if scheme == "data":
        return _data_url(url, cap)
    if scheme in ("http", "https"):
        return await _fetch(url, cap, settings.media_fetch_timeout)
    if scheme == "file":
        return await asyncio.to_thread(_local_file, url, cap, settings.allowed_local_media_path)
    raise APIError(400, f"image URLs must be data:, http(s): or file: URLs, got {url[:40]!r}")


def _data_url(url: str, cap: int) -> bytes:
    head, comma, payload = url.partition(",")
    if not comma or not head.lower().endswith(";base64"):
        raise APIError(400, "an image data URL must be data:<type>;base64,<data>")
    if len(payload) > cap * 4 // 3 + 4:
        raise APIError(400, f"the image is larger than {cap} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, "the image data URL is not valid base64") from None


async def _fetch(url: str, cap: int, timeout: float) -> bytes:
    try:
        async with (
            httpx.AsyncClient(timeout=timeout, follow_redirects=True) as client,
            client.stream("GET", url) as r,
        ):
            if r.status_code != 200:
                raise APIError(400, f"fetching the image failed: HTTP {r.status_code} from {url}")
            size = r.headers.get("content-length")
            if size is not None and size.isdigit() and int(size) > cap:
                raise APIError(400, f"the image at {url} is {size} bytes, more than {cap}")
            data = bytearray()
            async with asyncio.timeout(timeout):  # the whole body, not each read
                async for chunk in r.aiter_bytes():
                    data += chunk
                    if len(data) > cap:
                        raise APIError(400, f"the image at {url} is more than {cap} bytes")
            return bytes(data)
    except TimeoutError:
        raise APIError(400, f"fetching the image took more than {timeout:g} s: {url}") from None
    except httpx.HTTPError as e:
        raise APIError(400, f"fetching the image failed: {type(e).__name__} for {url}") from None


def _local_file(url: str, cap: int, allowed: str | None) -> bytes:
    if allowed is None:
        raise APIError(
            400, "file: image URLs are off; the server allows them under --allowed-local-media-path"
        )
    root = Path(allowed).resolve()
    path = Path(unquote(urlparse(url).path)).resolve()  # symlinks and .. resolved first
    if not path.is_relative_to(root):
        raise APIError(400, f"file: image URLs must point under {root}")
    try:
        size = path.stat().st_size
        if size > cap:
            raise APIError(400, f"the image file is {size} bytes, more than {cap}")
        return path.read_bytes()
    except OSError as e:
        raise APIError(400, f"cannot read the image file: {e.strerror or e}") from None
