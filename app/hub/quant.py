"""Pick the GGUF files of one model out of a repository's file list by quant tag.

A repo holds several quants of one model (`name-Q4_K_M.gguf`, `name-Q8_0.gguf`, ...), some split
into shards (`name-Q8_0-00001-of-00003.gguf`), and maybe `mmproj*.gguf` vision projectors.
A repo with no GGUF but a `save_pretrained` folder at its root is one model tagged
`safetensors`: config.json and the tokenizer and generation files beside it, and exactly the
weight shards `model.safetensors.index.json` names (a repo may also hold other weights, such
as Mistral's `consolidated.safetensors`, which are not fetched).
"""

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_QUANT = "Q4_K_M"
_SHARD = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
# The quant tag is the last `-`/`.`/`_`-separated component of the stem: Q4_K_M, IQ4_XS, BF16 ...
_TAG = re.compile(
    r"(?:^|[-._])(?P<tag>(?:UD-)?(?:I?Q\d(?:_[A-Z0-9]+)*|TQ\d_\d|BF16|F16|F32|FP16|FP32|MXFP4(?:_MOE)?))$",
    re.IGNORECASE,
)


SAFETENSORS = "safetensors"  # the tag of a Hugging Face folder model: `org/repo:safetensors`
HF_INDEX = "model.safetensors.index.json"
HF_SINGLE = "model.safetensors"
# What a folder model needs beside its weights (config.json first: the folder is its parent)
HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "preprocessor_config.json",  # MusicGen-Melody's chroma settings
)


class HubError(ValueError):
    """A model reference that cannot be resolved or fetched; the message says what exists."""


@dataclass(frozen=True)
class RepoFile:
    """One file of a repo: its path in the repo, size in bytes and LFS sha256 when known."""

    name: str
    size: int | None = None
    sha256: str | None = None


@dataclass(frozen=True)
class GGUFGroup:
    """One model inside a repo: its shards in order (one file when not split) and its quant tag."""

    stem: str
    quant: str | None
    files: tuple[RepoFile, ...]

    @property
    def size(self) -> int:
        return sum(f.size or 0 for f in self.files)


@dataclass(frozen=True)
class Resolved:
    """What to fetch for `repo:quant`: the model's shards and the matching mmproj, if any."""

    repo: str
    model: GGUFGroup
    mmproj: RepoFile | None

    @property
    def files(self) -> tuple[RepoFile, ...]:
        return self.model.files + ((self.mmproj,) if self.mmproj else ())

    @property
    def name(self) -> str:
        return f"{self.repo}:{self.model.quant or self.model.stem}"


def _basename(name: str) -> str:
    return name.rsplit("/", 1)[-1]


def is_mmproj(name: str) -> bool:
    return _basename(name).lower().startswith("mmproj")


def quant_of(stem: str) -> str | None:
    """The quant tag at the end of a file stem, upper-cased, or None."""
    m = _TAG.search(stem)
    return m["tag"].upper() if m else None


def group_ggufs(files: Iterable[RepoFile]) -> tuple[list[GGUFGroup], list[RepoFile]]:
    """Model GGUFs grouped into models (split shards together), and the mmproj files."""
    singles: list[GGUFGroup] = []
    shards: dict[tuple[str, int], dict[int, RepoFile]] = {}
    mmprojs: list[RepoFile] = []
    for f in sorted(files, key=lambda f: f.name):
        if not f.name.lower().endswith(".gguf"):
            continue
        if is_mmproj(f.name):
            mmprojs.append(f)
            continue
        m = _SHARD.match(f.name)
        if m:
            shards.setdefault((m["prefix"], int(m["count"])), {})[int(m["no"])] = f
        else:
            stem = f.name[: -len(".gguf")]
            singles.append(GGUFGroup(stem, quant_of(_basename(stem)), (f,)))
    for (prefix, count), parts in shards.items():
        if sorted(parts) != list(range(1, count + 1)):
            continue  # an incomplete split cannot be loaded; leave it out
        files_in_order = tuple(parts[i] for i in range(1, count + 1))
        singles.append(GGUFGroup(prefix, quant_of(_basename(prefix)), files_in_order))
    return sorted(singles, key=lambda g: g.stem), mmprojs


def _matches(group: GGUFGroup, quant: str) -> bool:
    want = quant.upper()
    if group.quant == want:
        return True
    # Tags outside our pattern (e.g. "UD-Q4_K_XL", "i1-Q4_K_M") match as a whole stem component.
    stem = _basename(group.stem).upper()
    return stem == want or bool(re.search(rf"(?:^|[-._]){re.escape(want)}$", stem))


def pick_mmproj(mmprojs: Sequence[RepoFile], quant: str | None) -> RepoFile | None:
    """The projector to go with a model: the same precision when present, else F16, BF16, F32."""
    if not mmprojs:
        return None
    by_tag = {quant_of(_basename(f.name)[: -len(".gguf")]): f for f in mmprojs}
    for tag in (quant, "F16", "BF16", "F32"):
        if tag in by_tag:
            return by_tag[tag]
    return mmprojs[0]


def available(groups: Sequence[GGUFGroup]) -> str:
    return ", ".join(g.quant or _basename(g.stem) for g in groups)


def hf_folder_group(
    repo: str, files: Iterable[RepoFile], index: Callable[[], Any] | None
) -> GGUFGroup | None:
    """The files of the folder model at the repo's root, or None when it has none. `index()`
    gives the parsed model.safetensors.index.json (read only when the repo has one)."""
    by_name = {f.name: f for f in files}
    if "config.json" not in by_name:
        return None
    if HF_INDEX in by_name:
        if index is None:
            raise HubError(f"{repo}: {HF_INDEX} must be read to know its shards")
        data = index()
        wmap = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wmap, dict) or not wmap:
            raise HubError(f"{repo}/{HF_INDEX} has no weight_map")
        shards = list(dict.fromkeys(str(v) for v in wmap.values()))
        missing = [n for n in shards if n not in by_name]
        if missing:
            raise HubError(f"{repo}: {HF_INDEX} names shards the repo lacks: {', '.join(missing)}")
        weights = [HF_INDEX, *shards]
    elif HF_SINGLE in by_name:
        weights = [HF_SINGLE]
    else:
        return None
    names = [n for n in HF_SIDE_FILES if n in by_name] + weights
    return GGUFGroup("model", SAFETENSORS, tuple(by_name[n] for n in names))


def resolve_files(
    repo: str,
    files: Iterable[RepoFile],
    quant: str | None,
    filename: str | None = None,
    index: Callable[[], Any] | None = None,
) -> Resolved:
    """The files of `repo:quant` (or of one named file); HubError says what the repo offers.
    A repo without GGUF files (or `quant` "safetensors") gives its folder model (see
    `hf_folder_group`; `index` reads its shard index)."""
    files = list(files)
    groups, mmprojs = group_ggufs(files)
    if (not groups or (quant or "").lower() == SAFETENSORS) and filename is None:
        folder = hf_folder_group(repo, files, index)
        if folder is not None and quant is not None and quant.lower() != SAFETENSORS:
            raise HubError(
                f"{repo} has no GGUF files but a safetensors model: pull it as {repo} and "
                f"quantize at load (--quantize q8_0, ...)"
            )
        if folder is not None:
            return Resolved(repo, folder, None)
    if not groups:
        names = ", ".join(f.name for f in files[:20]) or "no files"
        raise HubError(f"{repo} has no GGUF model files (it has: {names})")
    if filename is not None:
        chosen = [g for g in groups if any(f.name == filename for f in g.files)]
        if not chosen:
            raise HubError(f"{repo} has no GGUF file {filename}; models: {available(groups)}")
    elif quant is not None:
        chosen = [g for g in groups if _matches(g, quant)]
        if not chosen:
            raise HubError(f"{repo} has no {quant} quant; available: {available(groups)}")
    elif len(groups) == 1:
        chosen = groups
    else:
        chosen = [g for g in groups if g.quant == DEFAULT_QUANT]
        if not chosen:
            raise HubError(
                f"{repo} has no {DEFAULT_QUANT} (the default); pick one of: {available(groups)} "
                f"(e.g. {repo}:{groups[0].quant or _basename(groups[0].stem)})"
            )
    if len(chosen) > 1:
        names = ", ".join(g.stem for g in chosen)
        raise HubError(f"{repo}: {quant or DEFAULT_QUANT} matches several models ({names})")
    group = chosen[0]
    return Resolved(repo, group, pick_mmproj(mmprojs, group.quant))
