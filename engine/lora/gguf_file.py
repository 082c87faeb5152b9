"""llama.cpp LoRA GGUFs (`convert_lora_to_gguf.py` output) read as `LoraAdapter` pairs.

The file says `general.type = adapter`, `adapter.type = lora`, `adapter.lora.alpha`, and holds
`<base tensor>.lora_a` [r, in] and `.lora_b` [out, r] under the base's GGUF names, already in the
base's row order (the converter permuted llama's Q/K B rows). llama.cpp's scale is
alpha / r (alpha 0: 1), times the user's; we use the same.
"""

from pathlib import Path

from localllm.engine.gguf import GGUFError, open_gguf
from localllm.engine.layers.linear import dense
from localllm.engine.lora.adapter import LoraError, check_pair


def read_gguf_lora(path: Path, base) -> tuple[dict, dict]:
    try:
        f = open_gguf(path)
    except (GGUFError, OSError, ValueError) as e:
        raise LoraError(f"{path}: not a readable GGUF ({e})") from None
    with f:
        kind, sub = f.get("general.type"), f.get("adapter.type")
        if kind != "adapter" or sub != "lora":
            raise LoraError(
                f"{path}: not a LoRA adapter GGUF (general.type={kind!r}, adapter.type={sub!r})"
            )
        arch = f.architecture
        if arch != base.architecture:
            raise LoraError(f"{path}: adapter for {arch} models, the base is {base.architecture}")
        if f.get("adapter.alora.invocation_tokens") is not None:
            raise LoraError(f"{path}: activated LoRA (aLoRA) adapters are not supported")
        alpha = float(f.get("adapter.lora.alpha", 0.0) or 0.0)
        halves: dict[str, dict[str, str]] = {}
        for name in f.tensors:
            stem, _, ab = name.rpartition(".lora_")
            if ab not in ("a", "b") or not stem.endswith(".weight"):
                raise LoraError(f"{path}: tensor {name!r} is not a .lora_a/.lora_b tensor")
            halves.setdefault(stem.removesuffix(".weight"), {})[ab] = name
        if not halves:
            raise LoraError(f"{path}: holds no LoRA tensors")
        pairs, scalings = {}, {}
        for module, ab in halves.items():
            if set(ab) != {"a", "b"}:
                raise LoraError(f"{path}: {module} has lora_{next(iter(ab))} but not its pair")
            a = dense(f.weight(ab["a"])).float().clone()
            b = dense(f.weight(ab["b"])).float().clone()
            check_pair(str(path), module, a, b)
            pairs[module] = (a, b)
            scalings[module] = alpha / a.shape[0] if alpha else 1.0
    return pairs, scalings
