"""PEFT LoRA folders (`adapter_config.json` + `adapter_model.safetensors`) read as `LoraAdapter`
pairs under the base's GGUF names.

Module names go through the same table as the base's own tensors (`hf.plan.TensorPlan`: gguf-py's
name map, `model.layers.3.self_attn.q_proj` -> `blk.3.attn_q`), and each B through the family's
`adapt` (`engine/models/<family>_hf.py`), so a row change the converter makes to the base weight
(llama's Q/K rope permutation) is made to B's rows too, as llama.cpp's `convert_lora_to_gguf.py`
does. Only plain LoRA runs: DoRA, other PEFT types, embedding adapters and fan_in_fan_out are
refused by name.
"""

import json
import math
import re
from pathlib import Path

from localllm.engine.hf.config import HFConfig
from localllm.engine.hf.families import HF_FAMILIES, family_module
from localllm.engine.hf.plan import TensorPlan
from localllm.engine.hf.safetensors import SafetensorsError, SafetensorsFile
from localllm.engine.lora.adapter import LoraError, check_pair

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
# PEFT LoRA variants whose computation differs from plain LoRA's
_UNSUPPORTED = (
    "alora_invocation_tokens",
    "lora_bias",
    "use_qalora",
    "trainable_token_indices",
    "layer_replication",
    "use_bdlora",
    "target_parameters",
    "modules_to_save",
)
_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight")


def read_peft(folder: Path, base) -> tuple[dict, dict]:
    """(module -> (A, B), module -> scaling) for the base weights `base`."""
    cfg = _config(folder)
    try:
        st = SafetensorsFile(folder / WEIGHTS)
    except SafetensorsError as e:
        if not (folder / WEIGHTS).exists():
            bin_ = " (only adapter_model.bin: save it with safe_serialization)"
            found = bin_ if (folder / "adapter_model.bin").exists() else ""
            raise LoraError(f"{folder}: no {WEIGHTS}{found}") from None
        raise LoraError(str(e)) from None
    halves: dict[str, dict[str, str]] = {}
    for key in st.tensors:
        name = key.removeprefix(_PREFIX)
        if ".lora_embedding_" in name:
            raise LoraError(f"{folder}: {key}: LoRA on token embeddings is not supported")
        m = _KEY.fullmatch(name)
        if m is None:
            raise LoraError(
                f"{folder}: tensor {key!r} is not a lora_A/lora_B weight (modules_to_save, "
                "biases and DoRA magnitudes are not supported)"
            )
        halves.setdefault(m["module"], {})[m["ab"]] = key
    if not halves:
        raise LoraError(f"{folder}: {WEIGHTS} holds no LoRA tensors")
    for module, ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise LoraError(f"{folder}: {module} has lora_{next(iter(ab))} but not its pair")
    rows = _row_changes(folder, base, {m: st.tensors[ab["B"]] for m, ab in halves.items()})
    pairs, scalings = {}, {}
    for module, ab in halves.items():
        gguf_name, make = rows[module]
        a = st.view(ab["A"]).float().clone()
        b = st.view(ab["B"]).float()
        b = make(b) if make is not None else b.clone()
        check_pair(str(folder), module, a, b)
        r = a.shape[0]
        want = _pattern(cfg.get("rank_pattern"), module, cfg["r"])
        if r != want:
            raise LoraError(
                f"{folder}: {module}: bad rank: tensors have rank {r}, "
                f"adapter_config.json says {want}"
            )
        alpha = float(_pattern(cfg.get("alpha_pattern"), module, cfg["lora_alpha"]))
        pairs[gguf_name] = (a, b.contiguous())
        scalings[gguf_name] = alpha / (math.sqrt(r) if cfg.get("use_rslora") else r)
    return pairs, scalings


def _config(folder: Path) -> dict:
    path = folder / CONFIG
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LoraError(f"{folder}: no {CONFIG} (not a PEFT adapter folder)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoraError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"{path}: not a JSON object")
    kind = cfg.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise LoraError(f"{folder}: PEFT type {kind!r} is not supported (only LoRA)")
    if cfg.get("use_dora"):
        raise LoraError(f"{folder}: DoRA adapters (use_dora) are not supported, only plain LoRA")
    if cfg.get("fan_in_fan_out"):
        raise LoraError(f"{folder}: fan_in_fan_out adapters (Conv1D bases) are not supported")
    for key in _UNSUPPORTED:
        if cfg.get(key):
            raise LoraError(f"{folder}: adapter_config.json sets {key!r}, which we do not run")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if type(r) is not int or r < 1:
        raise LoraError(f"{folder}: bad rank: adapter_config.json 'r' is {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise LoraError(f"{folder}: adapter_config.json 'lora_alpha' is {alpha!r}")
    return cfg


def _pattern(patterns, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: the first key matching the module name's tail."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def _row_changes(folder: Path, base, b_tensors: dict) -> dict:
    """module -> (GGUF module name, the family's change of B's rows or None)."""
    cfg = base_config(base)
    arch = base.architecture
    n_layers = base.get(f"{arch}.block_count")
    plan = TensorPlan(arch, n_layers, {f"{m}.weight": t for m, t in b_tensors.items()})
    try:
        family_module(cfg.architecture).adapt(plan, cfg, None)
    except (KeyError, ValueError) as e:
        raise LoraError(f"{folder}: cannot map the adapter onto {arch}: {e}") from None
    out = {}
    for name, r in plan.entries.items():
        origin = plan.origin.get(name)
        if origin is None or not name.endswith(".weight"):
            continue  # made from the config (rope factors): no adapter tensor
        if r.sources != (origin,):
            raise LoraError(f"{folder}: {origin} maps onto several base tensors ({name})")
        out[origin.removesuffix(".weight")] = (name.removesuffix(".weight"), r.make)
    missing = [m for m in b_tensors if m not in out]
    if missing:
        raise LoraError(f"{folder}: {missing[0]} maps onto no single {arch} tensor")
    return out


def base_config(base) -> HFConfig:
    """The base's config.json, or for a GGUF the keys a family's `adapt` reads (its metadata)."""
    cfg = getattr(base, "config", None)
    if isinstance(cfg, HFConfig):
        return cfg
    arch = base.architecture
    hf_arch = next(
        (h for h in HF_FAMILIES if getattr(family_module(h), "ARCH", None) == arch), None
    )
    if hf_arch is None:
        raise LoraError(f"{base.path}: PEFT adapters are not mapped for {arch} models")
    n_head = base.get(f"{arch}.attention.head_count")
    return HFConfig({
        "architectures": [hf_arch],
        "num_attention_heads": n_head,
        "num_key_value_heads": base.get(f"{arch}.attention.head_count_kv", n_head),
        "num_hidden_layers": base.get(f"{arch}.block_count"),
        "num_experts": base.get(f"{arch}.expert_count"),  # (qwen3moe's adapt stacks experts)
    })  # fmt: skip
