"""Small readers of GGUF hyper-parameters shared by the model files (no per-arch branching)."""

import re
from collections.abc import Callable
from typing import Any

from localllm.engine.models.hparams import HyperparameterError, read


def arch_key(meta: dict[str, Any]) -> Callable[..., Any]:
    """k(name, default) reads `{general.architecture}.{name}`, checked against its type and range
    (`hparams.HPARAMS`); missing without default: KeyError. Defaults are taken as given."""
    arch = meta["general.architecture"]
    missing = object()

    def k(name: str, default: Any = missing) -> Any:
        key = f"{arch}.{name}"
        if key in meta:
            return read(key, name, meta[key])
        if default is missing:
            raise KeyError(f"GGUF metadata lacks required key '{key}'")
        return default

    return k


def rope_scale(meta: dict[str, Any]) -> float:
    """Linear rope scaling factor (1.0 when the model uses none or a kind handled elsewhere)."""
    k = arch_key(meta)
    if k("rope.scaling.type", "none") == "linear":
        return k("rope.scaling.factor", 1.0) or 1.0  # llama.cpp: a factor of 0 is no scaling
    return 1.0


_BLOCK = re.compile(r"blk\.(\d+)\.")


def unused_tensor(args: Any, name: str) -> bool:
    """Whether tensor `name` belongs to a block the family never runs (`ModelArgs.unused_blocks`,
    e.g. the multi-token-prediction layers a converter keeps): loading and planning skip it."""
    blocks = getattr(args, "unused_blocks", None)
    if not blocks:
        return False
    m = _BLOCK.match(name)
    return m is not None and int(m[1]) in blocks


def attention_layers(k: Callable[..., Any], n_layers: int) -> tuple[tuple[int, ...], int]:
    """Hybrids (lfm2, granitehybrid): which layers attend and their KV head count, from the
    per-layer `attention.head_count_kv` list (0: a recurrent layer, as llama.cpp reads it)."""
    kv = k("attention.head_count_kv")
    per_layer = kv if type(kv) is list else [kv] * n_layers
    if len(per_layer) != n_layers:
        raise HyperparameterError(
            f"attention.head_count_kv lists {len(per_layer)} layers, block_count is {n_layers}"
        )
    heads = {v for v in per_layer if v}
    if len(heads) > 1:
        raise HyperparameterError(
            f"attention.head_count_kv mixes {sorted(heads)}: one KV head count for every "
            "attention layer is supported"
        )
    layers = tuple(i for i, v in enumerate(per_layer) if v)
    return layers, heads.pop() if heads else 0
