"""Parse what a user names as a model: a path, a library name, `org/repo[:QUANT]` or a Hub URL."""

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

# Hub ids: `org/repo`, each part letters, digits, `-`, `_`, `.` (no leading dot or dash).
_REPO_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_HUB_SPEC = re.compile(rf"^(?P<repo>{_REPO_PART}/{_REPO_PART})(?::(?P<quant>[A-Za-z0-9._-]+))?$")
_HUB_HOSTS = ("huggingface.co/", "hf.co/")


@dataclass(frozen=True)
class ModelSpec:
    """One parsed model reference. `kind` is "path", "hub" or "name"."""

    kind: str
    text: str
    path: Path | None = None
    repo: str | None = None
    quant: str | None = None
    filename: str | None = None
    revision: str | None = None

    def pull_command(self) -> str:
        """The `localllm pull ...` line that fetches this hub spec."""
        return f"localllm pull {self.repo}" + (f":{self.quant}" if self.quant else "")


def parse_spec(text: str) -> ModelSpec:
    """Classify `text`; raise ValueError for an empty string or an unusable Hub URL."""
    text = text.strip()
    if not text:
        raise ValueError("empty model name")
    if text.startswith(("http://", "https://")):
        return _parse_url(text)
    for host in _HUB_HOSTS:
        if text.startswith(host):
            return _parse_url("https://" + text)
    path = Path(text).expanduser()
    looks_like_path = text.startswith(("/", "./", "../", "~")) or text.lower().endswith(".gguf")
    if looks_like_path or path.exists():
        return ModelSpec("path", text, path=path)
    m = _HUB_SPEC.match(text)
    if m:
        return ModelSpec("hub", text, repo=m["repo"], quant=m["quant"])
    return ModelSpec("name", text)


def _parse_url(url: str) -> ModelSpec:
    parts = [unquote(p) for p in urlparse(url).path.split("/") if p]
    if len(parts) < 2:
        raise ValueError(f"{url}: not a model URL (expected https://huggingface.co/org/repo)")
    repo = f"{parts[0]}/{parts[1]}"
    if not _HUB_SPEC.match(repo):
        raise ValueError(f"{url}: {repo!r} is not a valid repository id")
    rest = parts[2:]
    if not rest or rest[0] == "tree":
        revision = rest[1] if len(rest) > 1 else None
        return ModelSpec("hub", url, repo=repo, revision=revision)
    if rest[0] in ("blob", "resolve") and len(rest) >= 3:
        filename = "/".join(rest[2:])
        if not filename.lower().endswith(".gguf"):
            raise ValueError(f"{url}: {filename} is not a .gguf file")
        return ModelSpec("hub", url, repo=repo, filename=filename, revision=rest[1])
    raise ValueError(f"{url}: not a model URL (expected .../org/repo or .../resolve/REV/FILE.gguf)")
