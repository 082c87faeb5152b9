"""`attach_adapters`: load the named adapters, check them against the built model, and hang one
`LoraDelta` on every linear (and fused linear) they target; `LoraSet` is what the engine and
server then see: adapter ids (their order, as llama-server numbers `--lora`), names, global
scales, and the per-request choice resolved to (slot, factor) pairs.
"""

import math
from collections.abc import Sequence

import torch
from torch import nn

from localllm.engine.layers.linear import FusedLinear, QuantLinear
from localllm.engine.lora.adapter import LoraAdapter, LoraError, LoraSpec
from localllm.engine.lora.delta import LoraContext, LoraDelta
from localllm.engine.lora.load import load_adapter

# adapters one engine loads at once (each costs its ranks' columns in every targeted module)
MAX_ADAPTERS = 16


class LoraSet:
    """The loaded adapters; id = position in the `--lora` list."""

    def __init__(self, adapters: list[LoraAdapter], specs: Sequence[LoraSpec], ctx: LoraContext):
        self.adapters = adapters
        self.specs = tuple(specs)
        self.scales = [s.scale for s in specs]  # global: for requests that name no adapters
        self.context = ctx

    def __len__(self) -> int:
        return len(self.adapters)

    def by_name(self, name: str) -> int | None:
        return next((i for i, a in enumerate(self.adapters) if a.name == name), None)

    def resolve(self, lora: Sequence[tuple[int, float]] | None) -> tuple[tuple[int, float], ...]:
        """A request's (id, scale) list, or None for the global scales -> (slot, factor) pairs
        with a non-zero factor (an adapter not named runs at 0, as in llama-server)."""
        if lora is None:
            lora = list(enumerate(self.scales))
        out: dict[int, float] = {}
        for i, scale in lora:
            if type(i) is not int or not 0 <= i < len(self.adapters):
                raise ValueError(f"lora id {i!r} is not a loaded adapter (0..{len(self) - 1})")
            if not math.isfinite(scale):
                raise ValueError(f"lora scale {scale!r} is not a finite number")
            out[i] = float(scale)  # an id named twice: the last one, as llama-server
        return tuple((i, s) for i, s in sorted(out.items()) if s != 0.0)

    def set_scales(self, entries: Sequence[tuple[int, float]]) -> None:
        """POST /lora-adapters: the listed ids get these global scales, the others 0."""
        scales = [0.0] * len(self.adapters)
        for i, s in self.resolve(entries):
            scales[i] = s
        self.scales = scales

    def describe(self) -> list[dict]:
        """llama-server's GET /lora-adapters entries (plus our `name`)."""
        return [
            {"id": i, "path": a.path, "scale": self.scales[i], "task_name": "",
             "prompt_prefix": "", "name": a.name}
            for i, a in enumerate(self.adapters)
        ]  # fmt: skip

    def served(self) -> dict[str, int]:
        """Adapter names requests may give as their model (vLLM's --lora-modules) -> id."""
        return {a.name: i for i, (a, s) in enumerate(zip(self.adapters, self.specs, strict=True))
                if s.served}  # fmt: skip


def attach_adapters(
    model: nn.Module, specs: Sequence[LoraSpec], base, device, rows: int = 0
) -> LoraSet:
    """Load `specs` for the opened base weights `base` and hang them on `model` (built from it)."""
    if len(specs) > MAX_ADAPTERS:
        raise LoraError(f"{len(specs)} LoRA adapters given; at most {MAX_ADAPTERS} load at once")
    adapters = [load_adapter(s, base) for s in specs]
    names = [a.name for a in adapters]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise LoraError(f"two LoRA adapters are named {dup!r}; name them (NAME=PATH)")
    linears = _linears(model)
    for a in adapters:
        _check(a, linears)
    device = torch.device(device)
    ctx = LoraContext(len(adapters), device, rows)
    parts_of: dict[str, tuple] = {}
    for name, lin in linears.items():
        pairs = [
            (s, a.pairs[name], a.scalings[name]) for s, a in enumerate(adapters) if name in a.pairs
        ]
        if not pairs:
            continue
        a_cat = torch.cat([p[0] for _, p, _ in pairs]).to(device)
        b_cat = torch.cat([p[1] * k for _, p, k in pairs], dim=1).to(device)
        cols = [s for s, p, _ in pairs for _ in range(p[0].shape[0])]
        parts_of[name] = (a_cat, b_cat, cols)
        lin.lora = LoraDelta(ctx, [parts_of[name]])
        lin.lora.bind([(k, [lin.out_features]) for k in lin.kernels()])
    names_of = {id(m): n for n, m in linears.items()}
    for m in model.modules():
        if isinstance(m, FusedLinear) and any(names_of.get(id(p)) in parts_of for p in m.parts):
            m.lora = LoraDelta(
                ctx, [_part(names_of.get(id(p)), p, parts_of, device) for p in m.parts]
            )
            m.lora.bind(m.groups())
    setattr(model, "lora", ctx)  # noqa: B010 (the runner sets each step's rows through it)
    return LoraSet(adapters, specs, ctx)


def _part(name, lin: QuantLinear, parts_of: dict, device):
    if name in parts_of:
        return parts_of[name]
    empty_a = torch.zeros(0, lin.in_features, device=device)
    return empty_a, torch.zeros(lin.out_features, 0, device=device), []


def _linears(model: nn.Module) -> dict[str, QuantLinear]:
    """Every QuantLinear under its GGUF name (the family's aliases undone)."""
    back = {v: k for k, v in getattr(model, "tensor_aliases", {}).items()}
    out = {}
    for path, m in model.named_modules():
        if not isinstance(m, QuantLinear):
            continue
        parts = path.split(".")
        if parts[0] == "blk" and len(parts) > 2:
            rest = ".".join(parts[2:])
            out[f"blk.{parts[1]}.{back.get(rest, rest)}"] = m
        else:
            out[back.get(path, path)] = m
    return out


def _check(a: LoraAdapter, linears: dict[str, QuantLinear]) -> None:
    for name, (la, lb) in a.pairs.items():
        lin = linears.get(name)
        if lin is None or name in ("output", "token_embd"):
            raise LoraError(f"{a.path}: unknown target module {name!r}: this {a.arch} model has "
                            "no linear layer the adapter can apply to there")  # fmt: skip
        if la.shape[1] != lin.in_features or lb.shape[0] != lin.out_features:
            raise LoraError(
                f"{a.path}: {name}: adapter is [{lb.shape[0]} x {la.shape[1]}] but the base's "
                f"linear is [{lin.out_features} x {lin.in_features}] (an adapter of another base?)"
            )
