"""Verification records: which blobs of the Hugging Face cache hold exactly the published bytes.

A blob is verified when its hash equals the Hub's: the LFS sha256 (for an LFS file this is also
its ETag, so its blob name) or, for a small file kept in git, the git blob sha1 that is its ETag.
The proof is a record beside the blob, `blobs/<etag>.verified` (JSON: algorithm, digest, size,
mtime_ns), written only once the hash matched and the blob is in place. It survives restarts and
holds only while the blob's size and modification time are the recorded ones, so any write to the
file voids it and the blob is hashed again before it counts as a model. huggingface_hub reads
blobs only through snapshot links, so it and other tools sharing the cache never see the records.
"""

import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

RECORD_SUFFIX = ".verified"
CHUNK = 4 << 20  # bytes hashed between progress reports

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_SHA1 = re.compile(r"^[0-9a-f]{40}$")

HashProgress = Callable[[int, int], None]  # (bytes hashed, file size)


@dataclass(frozen=True)
class Digest:
    """What a file must hash to: `algo` is "sha256" or "git-sha1" (sha1 of "blob N\\0" + bytes)."""

    algo: str
    hex: str


def expected(etag: str, sha256: str | None = None) -> Digest | None:
    """The digest to check: the Hub's LFS sha256 when given, else what the ETag says; None when
    neither is a hash (such a file cannot be verified)."""
    if sha256:
        return Digest("sha256", sha256.lower())
    tag = etag.strip('"').removeprefix("W/").strip('"').lower()
    if _SHA256.match(tag):
        return Digest("sha256", tag)
    if _SHA1.match(tag):
        return Digest("git-sha1", tag)
    return None


def digest_of(path: Path, algo: str, progress: HashProgress | None = None) -> str:
    """The hex digest of `path`, reporting progress after each chunk."""
    size = os.path.getsize(path)
    # Named constructors rather than hashlib.new: tests hook hashlib.sha256 to pause mid-hash.
    h = hashlib.sha256() if algo == "sha256" else hashlib.sha1()
    if algo == "git-sha1":
        h.update(b"blob %d\0" % size)
    done = 0
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
            done += len(block)
            if progress:
                progress(done, size)
    if progress and size == 0:
        progress(0, 0)
    return h.hexdigest()


def matches(path: Path, want: Digest, progress: HashProgress | None = None) -> bool:
    return digest_of(path, want.algo, progress) == want.hex


def blob_of(pointer: Path) -> Path:
    """The blob a snapshot file stands for: the first hop of its link, as huggingface_hub's
    cache scan takes it (the blob may itself link into a shared store); itself when a copy."""
    if pointer.is_symlink():
        return Path(os.path.abspath(pointer.parent / os.readlink(pointer)))
    return pointer


def record_path(blob: Path) -> Path:
    return blob.with_name(blob.name + RECORD_SUFFIX)


def recorded(blob: Path) -> Digest | None:
    """The digest recorded for `blob`, or None when there is no record or the file changed since."""
    try:
        rec = json.loads(record_path(blob).read_text())
        st = blob.stat()
        if rec["size"] == st.st_size and rec["mtime_ns"] == st.st_mtime_ns:
            return Digest(rec["algo"], rec["digest"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def record(blob: Path, digest: Digest) -> None:
    """Record that `blob`, as it is now, hashes to `digest` (written atomically)."""
    st = blob.stat()
    rec = {
        "algo": digest.algo,
        "digest": digest.hex,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
    }
    path = record_path(blob)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(rec))
    os.replace(tmp, path)


def is_verified(blob: Path, want: Digest | None = None) -> bool:
    """A valid record whose digest is `want` (by default what the blob name, its ETag, says)."""
    got = recorded(blob)
    if got is None:
        return False
    want = want or expected(blob.name)
    return want is None or got == want


def forget(blob: Path) -> None:
    record_path(blob).unlink(missing_ok=True)


def orphans(blobs: Path) -> list[Path]:
    """Records in a `blobs` folder whose blob is gone (huggingface_hub deletes blobs, not ours)."""
    if not blobs.is_dir():
        return []
    return [
        r
        for r in blobs.glob(f"*{RECORD_SUFFIX}")
        if not r.with_name(r.name[: -len(RECORD_SUFFIX)]).exists()
    ]
