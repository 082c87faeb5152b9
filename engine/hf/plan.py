"""Which GGUF-named tensor comes from which checkpoint tensors, and how (`TensorPlan`).

Names start from gguf-py's `TensorNameMap` for the architecture: the table llama.cpp's converter
itself maps Hugging Face names with (`model.layers.3.self_attn.q_proj.weight` ->
`blk.3.attn_q.weight`). A name it does not know keeps its own, so the loader reports it as an
unexpected tensor. A family's `*_hf.py` then changes what the converter changes for it, through
`transform` (a function of the float tensor: llama's rope permutation, Gemma's norm + 1), `stack`
(per-expert tensors into one [experts, rows, cols]), `add` (tensors made from config.json: rope
factors) and `drop`. Entries left as stored are zero-copy views of the file's mapping.
"""

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch

from localllm.engine.hf.safetensors import StTensor

# buffers transformers saves that no GGUF has (llama.cpp's converter skips them too)
SKIPPED = (".rotary_emb.inv_freq", ".attention.masked_bias", ".attention.bias")


@dataclass(frozen=True)
class Recipe:
    """One GGUF tensor: read `sources` (checkpoint names; none for `values`), apply `make`."""

    shape: tuple[int, ...]
    dtype: str  # the stored dtype of the sources (safetensors name); "F32" for made values
    sources: tuple[str, ...] = ()
    make: Callable[..., torch.Tensor] | None = None  # float32 inputs -> float32 output
    values: torch.Tensor | None = None  # a tensor made from the config
    rows: int | None = None  # only the first rows of the one source (a view: no copy)

    @property
    def as_stored(self) -> bool:
        return self.make is None and self.values is None and len(self.sources) == 1


class TensorPlan:
    """GGUF name -> `Recipe`, built from a checkpoint's tensors (`tensors`: name -> StTensor)."""

    def __init__(
        self,
        arch: str,
        n_layers: int,
        tensors: dict[str, StTensor],
        rename: Callable[[str], str | None] | None = None,
    ):
        """`rename`: a family's checkpoint name -> the name the converter maps, or None to skip
        the tensor (a multimodal checkpoint's `language_model.` prefix, its vision tower)."""
        import gguf  # the converter's name tables (imported here: only loads of folders need it)

        by_name = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
        names = gguf.get_tensor_name_map(by_name[arch], n_layers) if arch in by_name else None
        self.entries: dict[str, Recipe] = {}
        self.origin: dict[str, str] = {}  # GGUF name -> the checkpoint name it came from
        for name, t in tensors.items():
            key = rename(name) if rename is not None else name
            if key is None or key.endswith(SKIPPED):
                continue
            new = names.get_name(key, try_suffixes=(".weight", ".bias")) if names else None
            new = new or key
            if new in self.entries:
                raise ValueError(f"tensors {self.origin[new]!r} and {name!r} both map to {new!r}")
            self.entries[new] = Recipe(t.shape, t.dtype, (name,))
            self.origin[new] = name

    def matching(self, pattern: str) -> list[str]:
        """GGUF names matching a regular expression (whole name)."""
        rx = re.compile(pattern)
        return [n for n in self.entries if rx.fullmatch(n)]

    def transform(self, pattern: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply `fn` (shape-preserving, on float32) to every tensor whose name matches."""
        for name in self.matching(pattern):
            r = self.entries[name]
            inner = r.make
            make = fn if inner is None else (lambda *xs, f=fn, g=inner: f(g(*xs)))
            self.entries[name] = replace(r, make=make)

    def add(self, name: str, values: torch.Tensor) -> None:
        self.entries[name] = Recipe(tuple(values.shape), "F32", values=values.float())

    def keep_rows(self, name: str, rows: int) -> None:
        """Only the first `rows` rows of `name` (gemma's embedding without its padding)."""
        r = self.entries[name]
        if r.make is not None or r.values is not None or len(r.sources) != 1:
            raise ValueError(f"{name}: keep_rows applies to a tensor as stored")
        self.entries[name] = replace(r, shape=(rows, *r.shape[1:]), rows=rows)

    def drop(self, name: str) -> None:
        self.entries.pop(name, None)

    def stack(self, parts: Iterable[str], name: str) -> None:
        """Replace the tensors `parts` (all present, one shape) by their stack under `name`."""
        parts = list(parts)
        missing = [p for p in parts if p not in self.entries]
        if missing:
            raise ValueError(f"missing tensor {self.origin.get(missing[0], missing[0])!r}")
        rs = [self.entries.pop(p) for p in parts]
        if len({r.shape for r in rs}) != 1:
            raise ValueError(f"{name}: the stacked tensors differ in shape")
        sources = tuple(s for r in rs for s in r.sources)
        makes = [r.make for r in rs]

        def make(*xs: torch.Tensor) -> torch.Tensor:
            return torch.stack([m(x) if m else x for m, x in zip(makes, xs, strict=True)])

        self.entries[name] = Recipe((len(rs), *rs[0].shape), rs[0].dtype, sources, make)

    def split(self, name: str, names: tuple[str, ...], dim: int) -> None:
        """Replace `name` by equal parts along `dim` (a fused gate_up into gate and up)."""
        r = self.entries.pop(name)
        n = len(names)
        size = r.shape[dim] // n
        shape = tuple(size if i == dim % len(r.shape) else s for i, s in enumerate(r.shape))
        for i, part in enumerate(names):

            def make(x: torch.Tensor, i=i, inner=r.make) -> torch.Tensor:
                x = inner(x) if inner else x
                return x.narrow(dim, i * size, size)

            self.entries[part] = Recipe(shape, r.dtype, r.sources, make)
