"""`LoraAdapter`: one adapter's low-rank pairs under the base's GGUF linear names; `LoraSpec`,
what the user named; `LoraError`; `check_pair`. `load.load_adapter` reads either format into it.

Each pair is A [r, in] and B [out, r] in float32, as `y = base(x) + scaling * (x @ A.T) @ B.T`
uses them; `scaling` is the adapter's own factor (PEFT: lora_alpha / r, or / sqrt(r) with
use_rslora; llama.cpp: adapter.lora.alpha / r), a request's scale multiplies it.
"""

from dataclasses import dataclass, field

import torch


class LoraError(ValueError):
    """An adapter that cannot be applied to this model (the message names the adapter)."""


@dataclass(frozen=True)
class LoraSpec:
    """What the user named: a path, its global scale (`--lora PATH:SCALE`), an optional name
    (vLLM's `--lora-modules NAME=PATH`; else the file or folder name)."""

    path: str
    scale: float = 1.0
    name: str | None = None
    served: bool = False  # a model name requests may give (`--lora-modules`; /v1/models lists it)

    @staticmethod
    def parse(text: str) -> "LoraSpec":
        """`PATH[:SCALE]`: a trailing `:number` is the scale (paths may hold other colons)."""
        path, sep, tail = text.rpartition(":")
        if sep and path:
            try:
                return LoraSpec(path, float(tail))
            except ValueError:
                pass
        return LoraSpec(text)


@dataclass
class LoraAdapter:
    name: str
    path: str
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module name -> (A [r, in], B [out, r])
    scalings: dict[str, float] = field(default_factory=dict)  # module name -> its factor
    arch: str | None = None

    @property
    def rank(self) -> int:
        return max(a.shape[0] for a, _ in self.pairs.values())


def check_pair(where: str, module: str, a: torch.Tensor, b: torch.Tensor) -> None:
    """A and B of one module agree on their rank."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] < 1 or a.shape[0] != b.shape[1]:
        raise LoraError(
            f"{where}: {module}: bad rank: lora_A is {tuple(a.shape)} and lora_B "
            f"{tuple(b.shape)} (need A [r, in] and B [out, r], r >= 1)"
        )
