"""One file from the Hub into the standard cache layout: resumable, verified before it is in place.

huggingface_hub (2.x) downloads into a process-unique temp file, so a download killed at 90 %
starts again from zero and leaves its partial file behind, and it never hashes what it fetched.
Here the partial file has a stable name (`blobs/<etag>.partial`), guarded by the same lock file
huggingface_hub uses for that blob, and the transfer itself is huggingface_hub's `http_get` with
`resume_size` (Range, retries). The partial file is hashed BEFORE it is renamed to its blob name
and linked, so a process killed at any moment leaves either no blob or a verified one; a blob that
is already there counts only with a valid verification record (`verify`) and is hashed again
otherwise. The blob, the snapshot link and the ref are laid out exactly as hf_hub_download does,
so other tools share the files.
"""

import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import get_hf_file_metadata, hf_hub_url
from huggingface_hub.file_download import http_get
from huggingface_hub.utils import WeakFileLock, build_hf_headers

from localllm.app.hub import verify
from localllm.app.hub.quant import HubError
from localllm.app.hub.verify import Digest, HashProgress

log = logging.getLogger(__name__)

_COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class Fetched:
    """A file in the cache: its snapshot path, bytes transferred and bytes hashed for it."""

    path: Path
    downloaded: int
    hashed: int


def partial_path(blob: Path) -> Path:
    return blob.with_name(blob.name + ".partial")


def blob_lock(blob: Path) -> WeakFileLock:
    """huggingface_hub's own lock for this blob: `<cache>/.locks/models--org--repo/<etag>.lock`."""
    folder = blob.parent.parent
    lock = folder.parent / ".locks" / folder.name / f"{blob.name}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    return WeakFileLock(lock)


def drop_blob(blob: Path) -> None:
    """Delete a blob, its record and every snapshot link to it (a dangling link would make
    huggingface_hub's cache scan reject the whole repo)."""
    for link in (blob.parent.parent / "snapshots").rglob("*"):
        if link.is_symlink() and verify.blob_of(link) == blob:
            link.unlink()
    verify.forget(blob)
    blob.unlink(missing_ok=True)


def check_blob(blob: Path, want: Digest, progress: HashProgress | None = None) -> tuple[bool, int]:
    """Whether an existing `blob` is verified, hashing it when its record is missing or stale,
    and the bytes hashed. A blob with the wrong hash is deleted with its links."""
    if verify.is_verified(blob, want):
        return True, 0
    with blob_lock(blob):
        if not blob.exists():
            return False, 0
        if verify.is_verified(blob, want):  # another process checked it meanwhile
            return True, 0
        size = blob.stat().st_size
        if verify.matches(blob, want, progress):
            verify.record(blob, want)
            return True, size
        log.warning("%s does not match its %s %s; deleting it", blob, want.algo, want.hex)
        drop_blob(blob)
        return False, size


def fetch_file(
    endpoint: str,
    cache_dir: Path,
    repo: str,
    name: str,
    revision: str | None = None,
    tqdm_class: type | None = None,
    *,
    sha256: str | None = None,
    on_hash: HashProgress | None = None,
) -> Fetched:
    """`repo/name` present and verified in the cache, downloading (or resuming) its blob when
    missing or damaged. `sha256` is the Hub's LFS hash; without it the ETag says what to check."""
    url = hf_hub_url(repo, name, revision=revision, endpoint=endpoint)
    meta = get_hf_file_metadata(url, endpoint=endpoint)
    if not meta.etag or not meta.commit_hash:
        raise HubError(f"{repo}/{name}: the Hub gave no ETag or commit for this file")
    want = verify.expected(meta.etag, sha256)
    if want is None:
        raise HubError(
            f"{repo}/{name}: cannot verify it: the Hub gave no sha256 and its ETag "
            f"{meta.etag} is not a hash"
        )
    folder = cache_dir / f"models--{repo.replace('/', '--')}"
    blob = folder / "blobs" / meta.etag
    pointer = folder / "snapshots" / meta.commit_hash / name
    blob.parent.mkdir(parents=True, exist_ok=True)
    downloaded = hashed = 0
    if blob.exists():
        _, hashed = check_blob(blob, want, on_hash)
    if not blob.exists():
        with blob_lock(blob):
            if not blob.exists():
                got, checked = _fetch_verified(
                    meta.location, blob, meta.size, want, f"{repo}/{name}", tqdm_class, on_hash
                )
                downloaded, hashed = got, hashed + checked
    _link(blob, pointer)
    rev = revision or "main"
    if not _COMMIT.match(rev):
        ref = folder / "refs" / rev
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(meta.commit_hash)
    return Fetched(pointer, downloaded, hashed)


def _fetch_verified(
    url: str,
    blob: Path,
    size: int | None,
    want: Digest,
    label: str,
    tqdm_class: type | None,
    on_hash: HashProgress | None,
) -> tuple[int, int]:
    """Download into the partial file, hash it, and only then rename it to `blob` and record it.

    A partial file left by a killed pull is resumed; if the result does not match, the old bytes
    may be the damaged ones, so it is fetched once more from the start. Returns the bytes
    transferred and hashed.
    """
    part = partial_path(blob)
    downloaded = hashed = 0
    while True:
        resumed, got = _transfer(url, part, size, label.rsplit("/", 1)[-1], tqdm_class)
        downloaded += got
        hashed += part.stat().st_size
        if verify.matches(part, want, on_hash):
            os.replace(part, blob)
            verify.record(blob, want)
            return downloaded, hashed
        part.unlink()
        if not resumed:
            raise HubError(
                f"{label}: {want.algo} mismatch after download (expected {want.hex}); "
                "the file was removed, try again"
            )
        log.warning("%s: the resumed download does not match; fetching it from the start", label)


def _transfer(
    url: str, part: Path, size: int | None, name: str, tqdm_class: type | None
) -> tuple[int, int]:
    """Fetch the missing tail of `part` (all of it when new); (bytes it held, bytes fetched)."""
    with open(part, "ab") as f:
        done = f.tell()
        if size is not None and done > size:  # not a prefix of this blob: start over
            f.truncate(0)
            done = 0
        if size is not None:
            free = shutil.disk_usage(part.parent).free
            if size - done > free:
                raise HubError(
                    f"{name}: not enough disk space in {part.parent} "
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
    return done, got - done


def _link(blob: Path, pointer: Path) -> None:
    pointer.parent.mkdir(parents=True, exist_ok=True)
    if pointer.is_symlink() or pointer.exists():
        pointer.unlink()
    try:
        pointer.symlink_to(os.path.relpath(blob, pointer.parent))
    except OSError:  # no symlinks here (some Windows setups): keep a copy, as huggingface_hub does
        shutil.copyfile(blob, pointer)
