"""Small readers of GGUF hyper-parameters shared by the model files (no per-arch branching)."""

from collections.abc import Callable
from typing import Any


def arch_key(meta: dict[str, Any]) -> Callable[..., Any]:
    """k(name, default) reads `{general.architecture}.{name}`; missing without default: error."""
    arch = meta["general.architecture"]
    missing = object()

    def k(name: str, default: Any = missing) -> Any:
        key = f"{arch}.{name}"
        if key in meta:
            return meta[key]
        if default is missing:
            raise KeyError(f"GGUF metadata lacks required key '{key}'")
        return default

    return k


def rope_scale(meta: dict[str, Any]) -> float:
    """Linear rope scaling factor (1.0 when the model uses none or a kind handled elsewhere)."""
    arch = meta["general.architecture"]
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "linear":
        return float(meta.get(f"{arch}.rope.scaling.factor", 1.0))
    return 1.0
