"""`ServerSettings`: what the HTTP layer knows beyond the engine (names, limits, auth, CORS).

Only `localllm.app.serve` builds it from flags; the server modules never read env or config.
"""

import time
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ServerSettings:
    model_id: str  # the id /v1/models reports (the file stem or --alias)
    model_names: frozenset[str] = frozenset()  # other names a request may use for it (file name)
    api_key: str | None = None  # when set, every route but /health needs `Bearer <key>`
    max_body_bytes: int = 8 * 1024 * 1024  # larger request bodies get 413 before parsing
    request_timeout: float | None = None  # seconds per request; None: no limit
    cors_origins: tuple[str, ...] = ()  # empty: no CORS headers at all
    max_prompt_chars: int | None = None  # longer prompt text gets 400 before tokenizing
    read_timeout: float | None = 30.0  # seconds for a request's headers, and for its body
    max_n: int = 16  # completions one request may ask for (n, times the prompts of a batch)
    created: int = field(default_factory=lambda: int(time.time()))
    owned_by: str = "localllm"
    reasoning_format: str = "deepseek"  # "none": `<think>` text stays in content
    # images (a model served with --mmproj): see app/server/media_inputs.py
    max_images_per_prompt: int = 8  # --limit-mm-per-prompt image=N
    max_image_bytes: int = 20 * 1024 * 1024  # one image's encoded bytes (data/http/file URL)
    max_videos_per_prompt: int = 1  # --limit-mm-per-prompt video=M
    max_video_bytes: int = 64 * 1024 * 1024  # one video's encoded bytes (data/http/file URL)
    media_fetch_timeout: float = 10.0  # seconds to fetch an http(s) image URL
    allowed_local_media_path: str | None = None  # file: image URLs only under it; None: off
    tool_format: str | None = None  # hermes/llama3/mistral/harmony/glm; None: the template's

    def accepts(self, model: str | None) -> bool:
        """A request may name the served model by its id or any of its other names, or omit it."""
        return not model or model == self.model_id or model in self.model_names
