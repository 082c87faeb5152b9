"""Residency settings: which tier (`device`, `host`, `disk`) each tensor may live in, and how.

A settings *layer* is a plain mapping with the keys of a residency document (TOML or JSON):

    budget = "6GiB"          # memory the plan may use on the compute device (CPU: RAM)
    load_mode = "mmap"       # or "read": copy resident weights into private memory
    experts = "disk"         # shortcut: every routed-expert tensor to this tier
    cpu_moe = true           # shortcut: experts on host (llama.cpp --cpu-moe)
    n_cpu_moe = 12           # shortcut: experts of the first 12 layers on host (--n-cpu-moe)
    host_compute = "auto"    # host-tier experts: "mapped" (a GPU reads them in place; slots keep
                             # recently used ones) where it can, else "host" (the CPU computes
                             # them); "split": mapped, and the CPU computes a share of each
                             # token's experts meanwhile (auto's choice where no slots cover
                             # them); "device": copied over per use
    split_share = 0.625      # split: the share of each decode token's experts the CPU computes
                             # (default: 5 of 8, the H200 box's best; 2 of 8 over device slots)
    rules = ["blk\\.[0-3]\\.ffn_.*_exps=device", {pattern = "output", tier = "host"}]
    [streaming]
    enabled = true           # disk-tier experts are streamed into slots
    slots = 16               # slot count (default: as many as the budget leaves)
    prefetch = true          # read ahead the experts the next layer's router guesses
                             # (unset: off; it measured slower)
    evict = "lru"            # or "lfu": the least used of the least recently used slots
    reads = "auto"           # who asks for a miss on a GPU: "gpu" (the decode step, one CUDA
                             # graph, asks a reader thread and waits on the device), "host" (a
                             # host step per layer); auto: gpu where the reader builds

Layers come from the command line, the environment and a document; `resolve` merges them with
the command line first: scalars from the first layer that sets them, rules concatenated in
precedence order (the first matching rule wins, as in llama.cpp's `-ot`; within a layer its own
rules come before its shortcuts). Unknown keys and bad values raise `ResidencyError`.
"""

import json
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TIERS = ("device", "host", "disk")
LOAD_MODES = ("mmap", "read")
HOST_COMPUTE = ("auto", "host", "device", "mapped", "split")
KEYS = (
    "budget",
    "load_mode",
    "experts",
    "cpu_moe",
    "n_cpu_moe",
    "host_compute",
    "split_share",
    "rules",
    "streaming",
)
STREAMING_KEYS = ("enabled", "slots", "prefetch", "evict", "reads")
EVICTIONS = ("lru", "lfu")
READS = ("auto", "gpu", "host")
# llama.cpp's --cpu-moe pattern: the three routed-expert tensors of every layer.
EXPERTS_PATTERN = r"\.ffn_(up|down|gate)_exps"
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)
# llama.cpp buffer-type names accepted as tiers (its -ot spells CPU / CUDA0 / Metal ...).
_DEVICE_NAMES = re.compile(r"^(gpu|cuda\d*|rocm\d*|metal|vulkan\d*|sycl\d*|mps)$", re.IGNORECASE)


class ResidencyError(ValueError):
    """A residency setting, document or plan is invalid (raised before any weight is read)."""


@dataclass(frozen=True, slots=True)
class Rule:
    pattern: str
    tier: str
    source: str = ""  # where it came from, for --show-plan

    def matches(self, name: str) -> bool:
        return re.search(self.pattern, name) is not None


@dataclass(frozen=True, slots=True)
class Streaming:
    enabled: bool = True
    slots: int | None = None  # None: as many as the budget leaves
    prefetch: bool | None = None  # None: off (measured slower, CPU-only and on a GPU)
    evict: str = "lru"  # "lru" or "lfu"
    reads: str = "auto"  # "auto", "gpu" or "host": who asks for a miss's read on a GPU


@dataclass(frozen=True, slots=True)
class ResidencyConfig:
    rules: tuple[Rule, ...] = ()
    streaming: Streaming = field(default_factory=Streaming)
    load_mode: str = "mmap"
    budget: int | None = None  # None: measured free memory
    # where host-tier experts are computed when the model runs on a separate device: "host"
    # ships the routed tokens' hidden rows to the CPU (llama.cpp --cpu-moe), "device" copies
    # the expert weights over per use
    host_compute: str = "auto"
    split_share: float | None = None  # None: engine.moe.split's defaults

    def tier_of(self, name: str) -> Rule | None:
        """The first rule matching `name`, or None (the planner decides)."""
        return next((r for r in self.rules if r.matches(name)), None)


def parse_size(value: str | int) -> int:
    """Bytes from `6GiB`, `512MiB`, `1.5G` (binary) or `6GB` (decimal) or a plain integer."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ResidencyError(f"size must be a string like '6GiB' or bytes, got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE.match(value)
        if m is None:
            raise ResidencyError(f"cannot read size {value!r} (write e.g. 6GiB, 512MiB, 8GB)")
        num, unit, binary, b = m.groups()
        scale = _UNITS[unit.lower()]
        if unit and b and not binary:  # "GB": decimal, as disks and vendors count
            scale = 1000 ** "bkmgt".index(unit.lower())
        n = int(float(num) * scale)
    if n <= 0:
        raise ResidencyError(f"size must be positive, got {value!r}")
    return n


def parse_tier(value: str) -> str:
    """A tier name; llama.cpp's buffer names map onto tiers (CPU -> host, CUDA0 -> device)."""
    if not isinstance(value, str):
        raise ResidencyError(f"tier must be a string, got {value!r}")
    v = value.strip()
    if v.lower() in TIERS:
        return v.lower()
    if v.lower() == "cpu":
        return "host"
    if _DEVICE_NAMES.match(v):
        return "device"
    raise ResidencyError(f"unknown tier {value!r} (one of {', '.join(TIERS)}; or CPU, CUDA0)")


def parse_rules(text: str, source: str = "") -> list[Rule]:
    """`PATTERN=TIER[,PATTERN=TIER...]`, the spelling of llama.cpp's `-ot`."""
    rules = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        pattern, sep, tier = part.rpartition("=")
        if not sep or not pattern:
            raise ResidencyError(f"rule {part!r} is not PATTERN=TIER")
        rules.append(_rule(pattern, tier, source))
    return rules


def _rule(pattern: str, tier: str, source: str) -> Rule:
    try:
        re.compile(pattern)
    except re.error as e:
        raise ResidencyError(f"{source}: bad pattern {pattern!r}: {e}") from None
    return Rule(pattern, parse_tier(tier), source)


def _check_keys(d: Mapping[str, Any], known: Sequence[str], where: str) -> None:
    if not isinstance(d, Mapping):
        raise ResidencyError(f"{where}: expected a table of settings, got {type(d).__name__}")
    unknown = [k for k in d if k not in known]
    if unknown:
        raise ResidencyError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(known)})")


def _typed(d: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    v = d[key]
    if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise ResidencyError(f"{where}: {key} must be an integer, got {v!r}")
    if kind is bool and not isinstance(v, bool):
        raise ResidencyError(f"{where}: {key} must be true or false, got {v!r}")
    return v


def parse_share(value: Any, source: str) -> float:
    """A split share: a number strictly between 0 and 1 (a string from the environment too)."""
    try:
        share = float(value) if not isinstance(value, bool) else None
    except (TypeError, ValueError):
        share = None
    if share is None or not 0 < share < 1:
        raise ResidencyError(f"{source}: split_share must be between 0 and 1, got {value!r}")
    return share


def validate_layer(d: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Check one settings layer and normalise it (tiers, sizes, rules parsed)."""
    _check_keys(d, KEYS, source)
    out: dict[str, Any] = {}
    if "budget" in d:
        out["budget"] = parse_size(d["budget"])
    if "load_mode" in d:
        if d["load_mode"] not in LOAD_MODES:
            raise ResidencyError(f"{source}: load_mode must be one of {', '.join(LOAD_MODES)}")
        out["load_mode"] = d["load_mode"]
    if "experts" in d:
        out["experts"] = parse_tier(d["experts"])
    if "host_compute" in d:
        if d["host_compute"] not in HOST_COMPUTE:
            raise ResidencyError(f"{source}: host_compute must be one of {', '.join(HOST_COMPUTE)}")
        out["host_compute"] = d["host_compute"]
    if "split_share" in d:
        out["split_share"] = parse_share(d["split_share"], source)
    if "cpu_moe" in d:
        out["cpu_moe"] = _typed(d, "cpu_moe", bool, source)
    if "n_cpu_moe" in d:
        out["n_cpu_moe"] = _typed(d, "n_cpu_moe", int, source)
        if out["n_cpu_moe"] < 0:
            raise ResidencyError(f"{source}: n_cpu_moe must be >= 0")
    if "rules" in d:
        out["rules"] = _rules_value(d["rules"], source)
    if "streaming" in d:
        s = d["streaming"]
        _check_keys(s, STREAMING_KEYS, f"{source} [streaming]")
        where = f"{source} [streaming]"
        out["streaming"] = {
            k: _typed(s, k, int if k == "slots" else bool, where)
            for k in s
            if k not in ("evict", "reads")
        }
        for key, allowed in (("evict", EVICTIONS), ("reads", READS)):
            if key in s:
                if s[key] not in allowed:
                    raise ResidencyError(f"{where}: {key} must be one of {', '.join(allowed)}")
                out["streaming"][key] = s[key]
        if out["streaming"].get("slots", 1) < 1:
            raise ResidencyError(f"{source} [streaming]: slots must be >= 1")
    return out


def _rules_value(value: Any, source: str) -> list[Rule]:
    if isinstance(value, str):
        return parse_rules(value, source)
    if not isinstance(value, list):
        raise ResidencyError(f"{source}: rules must be a list of PATTERN=TIER or tables")
    rules: list[Rule] = []
    for item in value:
        if isinstance(item, Rule):  # an already validated layer
            rules.append(item)
        elif isinstance(item, str):
            rules += parse_rules(item, source)
        else:
            _check_keys(item, ("pattern", "tier"), f"{source} rule")
            if "pattern" not in item or "tier" not in item:
                raise ResidencyError(f"{source}: a rule needs both pattern and tier: {item!r}")
            rules.append(_rule(item["pattern"], item["tier"], source))
    return rules


def load_document(path: str | Path) -> dict[str, Any]:
    """Read and validate a residency document (.toml, or .json; other names: JSON, then TOML)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ResidencyError(f"{path}: cannot read residency document ({e.strerror})") from None
    try:
        if path.suffix.lower() == ".toml":
            data = tomllib.loads(text)
        elif path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError:
                data = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ResidencyError(f"{path}: not a valid residency document: {e}") from None
    return validate_layer(data, str(path))


def _shortcut_rules(layer: Mapping[str, Any], source: str) -> list[Rule]:
    rules = []
    if layer.get("n_cpu_moe"):
        layers = "|".join(str(i) for i in range(layer["n_cpu_moe"]))
        pattern = rf"^blk\.({layers})\.ffn_(up|down|gate)_exps"
        rules.append(Rule(pattern, "host", f"{source} n_cpu_moe"))
    if layer.get("cpu_moe"):
        rules.append(Rule(EXPERTS_PATTERN, "host", f"{source} cpu_moe"))
    if "experts" in layer:
        rules.append(Rule(EXPERTS_PATTERN, layer["experts"], f"{source} experts"))
    return rules


def resolve(layers: Sequence[tuple[str, Mapping[str, Any]]]) -> ResidencyConfig:
    """Merge validated layers given highest precedence first (CLI, environment, document)."""
    rules: list[Rule] = []
    scalars: dict[str, Any] = {}
    streaming: dict[str, Any] = {}
    for source, raw in layers:
        layer = validate_layer(raw, source) if raw else {}
        rules += [*layer.get("rules", ()), *_shortcut_rules(layer, source)]
        for key in ("budget", "load_mode", "host_compute", "split_share"):
            if key in layer:
                scalars.setdefault(key, layer[key])
        for key, value in layer.get("streaming", {}).items():
            streaming.setdefault(key, value)
    return ResidencyConfig(tuple(rules), Streaming(**streaming), **scalars)
