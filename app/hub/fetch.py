"""One file from the Hub into the standard cache layout, resumable across killed processes.

huggingface_hub (2.x) downloads into a process-unique temp file, so a download killed at 90 %
starts again from zero and leaves its partial file behind. Here the partial file has a stable
name (`blobs/<etag>.partial`), guarded by the same lock file huggingface_hub uses for that blob,
and the transfer itself is huggingface_hub's `http_get` with `resume_size` (Range, retries).
The finished blob, the snapshot link and the ref are laid out exactly as hf_hub_download does,
so other tools share the files.
"""

import os
import re
import shutil
from pathlib import Path

from huggingface_hub import get_hf_file_metadata, hf_hub_url
from huggingface_hub.file_download import http_get
from huggingface_hub.utils import WeakFileLock, build_hf_headers

from localllm.app.hub.quant import HubError

_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def partial_path(blob: Path) -> Path:
    return blob.with_name(blob.name + ".partial")


def fetch_file(
    endpoint: str,
    cache_dir: Path,
    repo: str,
    name: str,
    revision: str | None = None,
    tqdm_class: type | None = None,
) -> Path:
    """The snapshot path of `repo/name`, downloading (or resuming) its blob when missing."""
    url = hf_hub_url(repo, name, revision=revision, endpoint=endpoint)
    meta = get_hf_file_metadata(url, endpoint=endpoint)
    if not meta.etag or not meta.commit_hash:
        raise HubError(f"{repo}/{name}: the Hub gave no ETag or commit for this file")
    folder = cache_dir / f"models--{repo.replace('/', '--')}"
    blob = folder / "blobs" / meta.etag
    pointer = folder / "snapshots" / meta.commit_hash / name
    if not blob.exists():
        blob.parent.mkdir(parents=True, exist_ok=True)
        lock = cache_dir / ".locks" / folder.name / f"{meta.etag}.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        with WeakFileLock(lock):
            if not blob.exists():
                _transfer(meta.location, blob, meta.size, name, tqdm_class)
    _link(blob, pointer)
    rev = revision or "main"
    if not _COMMIT.match(rev):
        ref = folder / "refs" / rev
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(meta.commit_hash)
    return pointer


def _transfer(url: str, blob: Path, size: int | None, name: str, tqdm_class: type | None) -> None:
    part = partial_path(blob)
    with open(part, "ab") as f:
        done = f.tell()
        if size is not None and done > size:  # not a prefix of this blob: start over
            f.truncate(0)
            done = 0
        if size is not None:
            free = shutil.disk_usage(blob.parent).free
            if size - done > free:
                raise HubError(
                    f"{name}: not enough disk space in {blob.parent} "
                    f"({size - done} bytes needed, {free} free)"
                )
        http_get(
            url,
            f,
            resume_size=done,
            headers=build_hf_headers(),
            expected_size=size,
            displayed_filename=name,
            tqdm_class=tqdm_class,
        )
    got = part.stat().st_size
    if size is not None and got != size:
        raise HubError(f"{name}: got {got} bytes, expected {size}; run the command again")
    os.replace(part, blob)


def _link(blob: Path, pointer: Path) -> None:
    pointer.parent.mkdir(parents=True, exist_ok=True)
    if pointer.is_symlink() or pointer.exists():
        pointer.unlink()
    try:
        pointer.symlink_to(os.path.relpath(blob, pointer.parent))
    except OSError:  # no symlinks here (some Windows setups): keep a copy, as huggingface_hub does
        shutil.copyfile(blob, pointer)
