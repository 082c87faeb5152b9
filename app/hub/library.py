"""The local model library: GGUF models in the Hugging Face cache plus user folders.

Hub models are named `org/repo:QUANT` (as pulled); loose files by their stem. Architecture and
context length come from the GGUF header (metadata only; tensors are not touched). Safetensors
models (a `save_pretrained` folder: a pulled repo, `org/repo:safetensors`, or a folder in a
user folder, named by the folder) take them from config.json.

A model of the HF cache is listed only when every file of it (shards, mmproj) has a valid
verification record (`verify`): a file from an interrupted pull, changed since it was checked,
or downloaded by another tool is not a ready model until `localllm pull` has hashed it. Such
models are returned only on request (`include_unverified`), marked `verified=False`, so `ls` can
name them and `rm` can delete them; the TUI and `-m NAME` never see them. Files in user folders
are the user's own and are not hashed.
"""

import json
import os
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from huggingface_hub import scan_cache_dir

from localllm.app.hub import verify
from localllm.app.hub.quant import (
    HF_INDEX,
    SAFETENSORS,
    GGUFGroup,
    HubError,
    RepoFile,
    group_ggufs,
    hf_folder_group,
    pick_mmproj,
)
from localllm.engine.gguf import GGUFError, open_gguf


@dataclass(frozen=True)
class LocalModel:
    """One model on disk. `repo`/`revision` are set for models in the HF cache."""

    name: str
    quant: str | None
    size: int
    paths: tuple[Path, ...]
    mmproj: Path | None
    architecture: str | None
    context_length: int | None
    location: str  # "hf-cache" or the user folder it was found in
    repo: str | None = None
    revision: str | None = None
    verified: bool = True  # False: an HF-cache file has no valid verification record

    @property
    def vision(self) -> bool:
        """It sees images: its Hub repository's mmproj was pulled with it. A user folder's
        models are not paired with the files beside them (they take `--mmproj FILE`)."""
        return self.mmproj is not None and self.location == "hf-cache"

    @property
    def path(self) -> Path:
        """What `-m` loads: the first shard, or a safetensors model's folder."""
        return self.paths[0].parent if self.quant == SAFETENSORS else self.paths[0]


def _header(path: Path) -> tuple[str | None, int | None]:
    if path.name == "config.json":  # a safetensors folder model
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
            cfg = {**cfg, **(cfg.get("text_config") or {})}
        except (OSError, ValueError, AttributeError):
            return None, None
        arch, ctx = cfg.get("model_type"), cfg.get("max_position_embeddings")
        return arch if isinstance(arch, str) else None, ctx if type(ctx) is int else None
    try:
        with open_gguf(path) as m:
            arch = m.architecture
            ctx = m.get(f"{arch}.context_length") if arch else None
            return arch, ctx if isinstance(ctx, int) else None
    except GGUFError:
        return None, None


def _model(
    group: GGUFGroup, base: Path, mmprojs: list[RepoFile], name: str, **kw: str | bool | None
) -> LocalModel:
    paths = tuple(base / f.name for f in group.files)
    mm = pick_mmproj(mmprojs, group.quant)
    arch, ctx = _header(paths[0])
    return LocalModel(
        name=name,
        quant=group.quant,
        size=group.size,
        paths=paths,
        mmproj=base / mm.name if mm else None,
        architecture=arch,
        context_length=ctx,
        **kw,
    )


def _all_verified(m: LocalModel, blobs: dict[Path, Path]) -> bool:
    files = m.paths + ((m.mmproj,) if m.mmproj else ())
    return all(p in blobs and verify.is_verified(blobs[p]) for p in files)


def _cache_models(cache_dir: Path) -> list[LocalModel]:
    if not cache_dir.is_dir():
        return []
    out: list[LocalModel] = []
    for repo in sorted(scan_cache_dir(cache_dir).repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        seen: set[str] = set()
        # Newest revision first, so each model is listed once, at its latest cached commit.
        for rev in sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True):
            files = [
                RepoFile(f.file_path.relative_to(rev.snapshot_path).as_posix(), f.size_on_disk)
                for f in rev.files
            ]
            blobs = {f.file_path: f.blob_path for f in rev.files}
            groups, mmprojs = group_ggufs(files)
            folder = _folder_group(repo.repo_id, files, rev.snapshot_path)
            for g in [*groups, *([folder] if folder else [])]:
                name = f"{repo.repo_id}:{g.quant or Path(g.stem).name}"
                if name in seen:
                    continue
                seen.add(name)
                m = _model(
                    g,
                    rev.snapshot_path,
                    mmprojs,
                    name,
                    location="hf-cache",
                    repo=repo.repo_id,
                    revision=rev.commit_hash,
                )
                out.append(replace(m, verified=_all_verified(m, blobs)))
    return out


def _folder_group(repo: str, files: list[RepoFile], base: Path) -> GGUFGroup | None:
    """The safetensors model at `base` (a snapshot or a folder), or None."""

    def index() -> object:
        return json.loads((base / HF_INDEX).read_text(encoding="utf-8"))

    try:
        return hf_folder_group(repo, files, index)
    except (HubError, OSError, ValueError):
        return None  # an index that is not there or not readable: not a ready model


def _folder_models(folder: Path) -> list[LocalModel]:
    if not folder.is_dir():
        return []
    files = [
        RepoFile(p.relative_to(folder).as_posix(), p.stat().st_size)
        for p in folder.rglob("*.gguf")
        if p.is_file()
    ]
    groups, mmprojs = group_ggufs(files)
    out = [_model(g, folder, mmprojs, Path(g.stem).name, location=str(folder)) for g in groups]
    for sub in sorted(p.parent for p in folder.glob("*/config.json")):  # save_pretrained folders
        names = [RepoFile(p.name, p.stat().st_size) for p in sub.iterdir() if p.is_file()]
        g = _folder_group(sub.name, names, sub)
        if g is not None:
            out.append(_model(g, sub, [], sub.name, location=str(folder)))
    return out


def scan_library(
    cache_dir: Path, extra_dirs: Iterable[Path] = (), *, include_unverified: bool = False
) -> list[LocalModel]:
    """Every GGUF model in the HF cache and the extra folders; cached models whose files are
    not verified only with `include_unverified` (see the module docstring)."""
    models = [m for m in _cache_models(cache_dir) if include_unverified or m.verified]
    for d in extra_dirs:
        models.extend(_folder_models(Path(d).expanduser()))
    return models


def find_model(name: str, models: Sequence[LocalModel]) -> LocalModel:
    """The model called `name` (case-insensitive; `org/repo` alone when it has one model)."""
    want = name.lower()
    hits = [m for m in models if m.name.lower() == want]
    if not hits:
        hits = [m for m in models if m.repo and m.repo.lower() == want]
    if len(hits) == 1:
        return hits[0]
    if len(hits) > 1:
        names = ", ".join(m.name for m in hits)
        raise HubError(f"{name} matches several models: {names}")
    known = ", ".join(m.name for m in models) or "none (use `localllm pull org/repo`)"
    raise HubError(f"no model named {name} in the library; models: {known}")


def remove_model(model: LocalModel, cache_dir: Path) -> int:
    """Delete one cached model's files (shards; the mmproj when no other model uses it).

    Blobs still linked from another snapshot stay. When the revision holds nothing else, it
    goes through huggingface_hub's cache API so refs and snapshot folders are cleaned too.
    Returns the bytes freed.
    """
    if model.repo is None or model.revision is None:
        raise HubError(
            f"{model.name} is not in the Hugging Face cache; delete {model.location} files yourself"
        )
    others = [
        m
        for m in _cache_models(cache_dir)
        if m.repo == model.repo and m.revision == model.revision and m.name != model.name
    ]
    doomed = list(model.paths)
    if model.mmproj and not any(m.mmproj == model.mmproj for m in others):
        doomed.append(model.mmproj)
    rest = [p for p in _snapshot_files(model, cache_dir) if p not in doomed]
    folder = cache_dir / f"models--{model.repo.replace('/', '--')}"
    if not others and not rest:
        info = scan_cache_dir(cache_dir)
        before = info.size_on_disk
        info.delete_revisions(model.revision).execute()
        for record in verify.orphans(folder / "blobs"):  # huggingface_hub leaves our records
            record.unlink(missing_ok=True)
        # a folder's disk-tier spill files (engine/hf/spill.py) live beside the snapshots
        shutil.rmtree(folder / ".localllm" / model.revision, ignore_errors=True)
        return before - scan_cache_dir(cache_dir).size_on_disk
    links = _all_links(folder / "snapshots")
    freed = 0
    for pointer in doomed:
        blob = Path(os.path.realpath(pointer))
        pointer.unlink(missing_ok=True)
        if blob != pointer and blob.exists() and links.get(blob, 0) <= 1:
            freed += blob.stat().st_size
            verify.forget(blob)
            blob.unlink()
    return freed


def _snapshot_files(model: LocalModel, cache_dir: Path) -> list[Path]:
    folder = cache_dir / f"models--{model.repo.replace('/', '--')}" / "snapshots" / model.revision
    return [p for p in folder.rglob("*") if p.is_symlink() or p.is_file()]


def _all_links(snapshots: Path) -> dict[Path, int]:
    counts: dict[Path, int] = {}
    for p in snapshots.rglob("*"):
        if p.is_symlink():
            target = Path(os.path.realpath(p))
            counts[target] = counts.get(target, 0) + 1
    return counts
