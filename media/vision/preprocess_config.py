"""Preprocessing settings a model brings: pixel bounds, video sampling and the video time scale,
read from the mmproj and from a Hugging Face folder's sidecar files, over the family defaults.

Sources, later ones winning: the family processor's built-in defaults (transformers' own), the
mmproj's `clip.vision.image_min_pixels` / `image_max_pixels` (llama.cpp's keys, where its
converter writes them), then, for a text model that is a Hugging Face folder, its
`preprocessor_config.json` (`min_pixels`, `max_pixels`, or `size.shortest_edge` /
`size.longest_edge` as newer transformers writes them), `video_preprocessor_config.json` (the
same for video frames, and `fps`, `min_frames`, `max_frames`) and `config.json`'s
`vision_config.tokens_per_second`; finally the caller's explicit overrides. A GGUF file's
neighbours are never read (two models in one folder must not be mixed). Values are checked:
a malformed one is a `VisionConfigError` naming the file and key.
"""

import json
import os
from pathlib import Path
from typing import Any

from localllm.media.vision.siglip import VisionConfigError

# what a processor or the video sampler may take (`VisionPipeline` routes each)
PROCESSOR_KEYS = ("min_pixels", "max_pixels", "video_min_pixels", "video_max_pixels",
                  "tokens_per_second")  # fmt: skip
SAMPLING_KEYS = {"video_fps": "fps", "video_min_frames": "min_frames",
                 "video_max_frames": "max_frames"}  # fmt: skip
KEYS = (*PROCESSOR_KEYS, *SAMPLING_KEYS)


def from_mmproj(meta: dict[str, Any]) -> dict[str, Any]:
    """The settings an mmproj's metadata carries."""
    out = {}
    for key, name in (("image_min_pixels", "min_pixels"), ("image_max_pixels", "max_pixels")):
        v = meta.get(f"clip.vision.{key}")
        if v is not None:
            out[name] = _positive(v, f"clip.vision.{key}", int)
    return out


def from_folder(folder: str | os.PathLike) -> dict[str, Any]:
    """The settings of a Hugging Face model folder's sidecar files (absent files: none)."""
    folder = Path(folder)
    out: dict[str, Any] = {}
    image = _json(folder / "preprocessor_config.json")
    out.update(_bounds(image, "", folder / "preprocessor_config.json"))
    video_file = folder / "video_preprocessor_config.json"
    video = _json(video_file)
    out.update(_bounds(video, "video_", video_file))
    for key, name in (("fps", "video_fps"), ("min_frames", "video_min_frames"),
                      ("max_frames", "video_max_frames")):  # fmt: skip
        if video.get(key) is not None:
            kind = float if key == "fps" else int
            out[name] = _positive(video[key], f"{video_file.name}: {key}", kind)
    cfg = _json(folder / "config.json")
    vision = cfg.get("vision_config") if isinstance(cfg.get("vision_config"), dict) else {}
    if vision.get("tokens_per_second") is not None:
        tps = vision["tokens_per_second"]
        out["tokens_per_second"] = _positive(tps, "config.json: tokens_per_second", float)
    return out


def check(overrides: dict[str, Any]) -> dict[str, Any]:
    """Explicit overrides, their names and values checked."""
    unknown = sorted(set(overrides) - set(KEYS))
    if unknown:
        raise VisionConfigError(f"unknown preprocessing settings {unknown} (known: {KEYS})")
    return {k: _positive(v, k, float if k in ("tokens_per_second", "video_fps") else int)
            for k, v in overrides.items()}  # fmt: skip


def _bounds(cfg: dict, prefix: str, where: Path) -> dict[str, Any]:
    size = cfg.get("size") if isinstance(cfg.get("size"), dict) else {}
    out = {}
    for name, alias in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        v = cfg.get(name, size.get(alias))
        if v is not None:
            out[prefix + name] = _positive(v, f"{where.name}: {name}", int)
    if out.get(prefix + "min_pixels", 0) > out.get(prefix + "max_pixels", float("inf")):
        raise VisionConfigError(f"{where}: min_pixels is above max_pixels")
    return out


def _json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        got = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise VisionConfigError(f"{path}: not readable JSON: {e}") from None
    if not isinstance(got, dict):
        raise VisionConfigError(f"{path}: expected a JSON object")
    return got


def _positive(v: Any, what: str, kind: type) -> int | float:
    if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0 or kind(v) != v:
        raise VisionConfigError(f"{what} is {v!r}: expected a positive {kind.__name__}")
    return kind(v)
