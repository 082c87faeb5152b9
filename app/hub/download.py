"""Fetch `org/repo[:QUANT]` into the standard Hugging Face cache with huggingface_hub.

huggingface_hub does the transfer (retries with Range) into its blob/snapshot layout shared with
other tools, through `fetch.fetch_file`, which also resumes a download whose process was killed
and hashes every file against the Hub's sha256 before it goes in place; we add the quant
resolution, a disk-space check up front, progress and offline handling. A model counts as cached
only when every file of it carries a valid verification record (`verify`); a file without one is
hashed again (offline too, against the sha256 that is its blob name) instead of being trusted.
"""

import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from huggingface_hub import HfApi, constants
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from localllm.app.hub import verify
from localllm.app.hub.fetch import Fetched, check_blob, drop_blob, fetch_file
from localllm.app.hub.progress import (
    ProgressCallback,
    hash_reporter,
    human_bytes,
    progress_class,
    terminal_printer,
)
from localllm.app.hub.quant import (
    HF_INDEX,
    SAFETENSORS,
    HubError,
    RepoFile,
    Resolved,
    resolve_files,
)

# Leave room for the filesystem and other writers beyond the bytes we fetch.
DISK_MARGIN = 64 * 1024 * 1024


@dataclass(frozen=True)
class HubConfig:
    """Where the Hub and the cache are; `current()` takes huggingface_hub's own env settings."""

    endpoint: str
    cache_dir: Path
    offline: bool = False

    @classmethod
    def current(cls) -> "HubConfig":
        # Read at call time: huggingface_hub parses HF_ENDPOINT / HF_HUB_CACHE / HF_HUB_OFFLINE.
        return cls(constants.ENDPOINT, Path(constants.HF_HUB_CACHE), constants.is_offline_mode())


@dataclass(frozen=True)
class PulledModel:
    """A model present in the cache: its shards in order, its mmproj, and the commit."""

    name: str
    repo: str
    quant: str | None
    revision: str
    paths: tuple[Path, ...]
    mmproj: Path | None
    downloaded: int  # bytes fetched by this call (0 when everything was cached)
    verified: int = 0  # bytes hashed by this call (0 when every file had a valid record)

    @property
    def path(self) -> Path:
        """What `-m` loads: the first shard, or a safetensors model's folder."""
        return self.paths[0].parent if self.quant == SAFETENSORS else self.paths[0]

    @property
    def files(self) -> tuple[Path, ...]:
        return self.paths + ((self.mmproj,) if self.mmproj else ())


def repo_folder(config: HubConfig, repo: str) -> Path:
    return config.cache_dir / f"models--{repo.replace('/', '--')}"


def cached_files(
    config: HubConfig, repo: str, revision: str = "main"
) -> tuple[str, list[RepoFile]]:
    """The commit and files of `repo` at `revision` as the cache holds them (no network)."""
    folder = repo_folder(config, repo)
    ref = folder / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = folder / "snapshots" / commit
    if not snapshot.is_dir():
        raise HubError(f"{repo} is not in the cache ({config.cache_dir})")
    files = [
        RepoFile(p.relative_to(snapshot).as_posix(), p.stat().st_size)
        for p in sorted(snapshot.rglob("*"))
        if p.is_file()
    ]
    return commit, files


def remote_files(config: HubConfig, repo: str, revision: str | None) -> tuple[str, list[RepoFile]]:
    """The commit and files (sizes, LFS sha256) of `repo` on the Hub; HubError on 404 etc."""
    api = HfApi(endpoint=config.endpoint)
    try:
        info = api.model_info(repo, revision=revision, files_metadata=True)
    except RepositoryNotFoundError:
        raise HubError(
            f"{repo}: no such model repository on {config.endpoint} (or it is private)"
        ) from None
    except GatedRepoError:
        raise HubError(f"{repo} is gated: accept its terms on the Hub and log in") from None
    except RevisionNotFoundError:
        raise HubError(f"{repo} has no revision {revision!r}") from None
    except Exception as e:
        if not _network_error(e):
            raise
        raise HubError(
            f"cannot reach {config.endpoint} for {repo} ({e}); set HF_HUB_OFFLINE=1 to use only "
            "cached models"
        ) from None
    files = [
        RepoFile(
            s.rfilename,
            s.lfs.size if s.lfs else s.size,
            s.lfs.sha256 if s.lfs else None,
        )
        for s in info.siblings or []
    ]
    return info.sha or revision or "main", files


def _network_error(e: Exception) -> bool:
    # huggingface_hub's transport errors come from its HTTP client package; match them by module.
    module = type(e).__module__
    return isinstance(e, HfHubHTTPError | OSError) or module.startswith(("httpx", "httpcore"))


def cached_model(
    config: HubConfig,
    repo: str,
    quant: str | None = None,
    filename: str | None = None,
    revision: str = "main",
) -> PulledModel | None:
    """`repo:quant` from the cache alone (no hashing), or None when it (or a shard) is not there
    or a file of it is not verified."""
    found = _cached(config, repo, quant, filename, revision)
    if found is None or not all(_verified(p) for p in found.files):
        return None
    return found


def _cached(
    config: HubConfig, repo: str, quant: str | None, filename: str | None, revision: str
) -> PulledModel | None:
    try:
        commit, files = cached_files(config, repo, revision)
        snapshot = repo_folder(config, repo) / "snapshots" / commit
        resolved = resolve_files(repo, files, quant, filename, lambda: _read_index(snapshot))
    except HubError:
        return None
    return _pulled(resolved, commit, snapshot, 0)


def _read_index(snapshot: Path) -> object:
    """A cached model.safetensors.index.json, parsed (HubError when it is not JSON)."""
    try:
        return json.loads((snapshot / HF_INDEX).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HubError(f"{snapshot / HF_INDEX}: cannot read ({e})") from None


def _verified(pointer: Path, sha256: str | None = None) -> bool:
    """A snapshot file whose blob has a valid record (for `sha256` when given)."""
    if not pointer.exists():
        return False
    blob = verify.blob_of(pointer)
    return verify.is_verified(blob, verify.expected(blob.name, sha256))


def _pulled(resolved: Resolved, commit: str, snapshot: Path, downloaded: int) -> PulledModel:
    paths = tuple(snapshot / f.name for f in resolved.model.files)
    mmproj = snapshot / resolved.mmproj.name if resolved.mmproj else None
    return PulledModel(
        resolved.name, resolved.repo, resolved.model.quant, commit, paths, mmproj, downloaded
    )


def check_disk_space(directory: Path, needed: int) -> None:
    """HubError when the filesystem holding `directory` has less than `needed` bytes free."""
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed + DISK_MARGIN:
        raise HubError(
            f"not enough disk space in {directory}: need {human_bytes(needed)} "
            f"(+{human_bytes(DISK_MARGIN)} margin), {human_bytes(free)} free"
        )


def _discard(pointer: Path) -> None:
    """Remove one freshly fetched file: the snapshot link and the blob it points to."""
    blob = verify.blob_of(pointer)
    pointer.unlink(missing_ok=True)
    if blob != pointer:
        drop_blob(blob)


def _verify_offline(found: PulledModel, progress: ProgressCallback | None) -> PulledModel:
    """Hash the files of a cached model that have no valid record, against their blob names."""
    hashed = 0
    for pointer in found.files:
        blob = verify.blob_of(pointer)
        want = verify.expected(blob.name)
        label = f"{found.repo}/{pointer.name}"
        if want is None:
            raise HubError(
                f"{label}: cannot verify it offline (its blob name is not a hash); "
                "unset HF_HUB_OFFLINE to check it against the Hub"
            )
        on_hash = hash_reporter(pointer.name, progress) if progress else None
        ok, n = check_blob(blob, want, on_hash)
        hashed += n
        if not ok:
            raise HubError(
                f"{label}: {want.algo} mismatch in the cache (the file is damaged) and it was "
                "removed; unset HF_HUB_OFFLINE to download it again"
            )
    return replace(found, verified=hashed)


def pull(
    repo: str,
    quant: str | None = None,
    *,
    filename: str | None = None,
    revision: str | None = None,
    config: HubConfig | None = None,
    progress: ProgressCallback | None = None,
) -> PulledModel:
    """Make `repo:quant` present in the cache, downloading what is missing; return its paths."""
    config = config or HubConfig.current()
    if config.offline:
        found = _cached(config, repo, quant, filename, revision or "main")
        if found is None:
            spec = repo + (f":{quant}" if quant else "")
            raise HubError(
                f"offline mode (HF_HUB_OFFLINE) is on and {spec} is not in the cache "
                f"({config.cache_dir}); unset HF_HUB_OFFLINE to download it"
            )
        return _verify_offline(found, progress)
    fetched: list[Fetched] = []
    commit, resolved = resolve_remote(config, repo, quant, filename, revision, progress, fetched)
    snapshot = repo_folder(config, repo) / "snapshots" / commit
    # Present is not enough: a file counts only with a valid record for the Hub's sha256.
    missing = [f for f in resolved.files if not _verified(snapshot / f.name, f.sha256)]
    check_disk_space(config.cache_dir, sum(f.size or 0 for f in missing))
    done: list[Fetched] = fetched
    try:
        for f in missing:
            done.append(_download(config, repo, f, revision, progress))
    except BaseException:
        for got in done:
            if got.downloaded:  # files that were in the cache before this call stay
                _discard(got.path)
        raise
    pulled = _pulled(resolved, commit, snapshot, sum(g.downloaded for g in done))
    return replace(pulled, verified=sum(g.hashed for g in done))


def resolve_remote(
    config: HubConfig,
    repo: str,
    quant: str | None,
    filename: str | None = None,
    revision: str | None = None,
    progress: ProgressCallback | None = None,
    fetched: list[Fetched] | None = None,
) -> tuple[str, Resolved]:
    """The commit and the files of `repo:quant` on the Hub. A safetensors model's shard list
    is in its index, which is fetched (verified, into the cache) for that; `fetched` gets it."""
    commit, files = remote_files(config, repo, revision)
    snapshot = repo_folder(config, repo) / "snapshots" / commit

    def index() -> object:
        entry = next(f for f in files if f.name == HF_INDEX)
        if not _verified(snapshot / HF_INDEX, entry.sha256):
            got = _download(config, repo, entry, revision, progress)
            if fetched is not None:
                fetched.append(got)
        return _read_index(snapshot)

    return commit, resolve_files(repo, files, quant, filename, index)


def pull_spec(spec, config: HubConfig) -> PulledModel:
    """`pull` a parsed `org/repo[:QUANT]` spec (or Hub URL) with a progress line on stderr."""
    return pull(
        spec.repo,
        spec.quant,
        filename=spec.filename,
        revision=spec.revision,
        config=config,
        progress=terminal_printer(),
    )


def _download(
    config: HubConfig,
    repo: str,
    f: RepoFile,
    revision: str | None,
    progress: ProgressCallback | None,
) -> Fetched:
    name = f.name
    tqdm_class = progress_class(name, progress) if progress else None
    on_hash = hash_reporter(name, progress) if progress else None
    try:
        return fetch_file(
            config.endpoint,
            config.cache_dir,
            repo,
            name,
            revision,
            tqdm_class,
            sha256=f.sha256,
            on_hash=on_hash,
        )
    except (EntryNotFoundError, RevisionNotFoundError, RepositoryNotFoundError) as e:
        raise HubError(f"{repo}/{name}: not found on {config.endpoint} ({e})") from None
    except OfflineModeIsEnabled:
        raise HubError(f"offline mode (HF_HUB_OFFLINE) is on; cannot download {repo}") from None
