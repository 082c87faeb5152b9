"""Pooling: one vector per sequence from its hidden states, and which pooling a model uses.

Methods: `mean` over the tokens, `cls` (the first token) and `last` (the last token). A GGUF names
its pooling in `<arch>.pooling_type` (llama.cpp's enum); without one, encoders pool by the mean
(sentence-transformers' default) and decoders by the last token (whose state has seen the whole
text under causal attention).
"""

from typing import Any

import torch
import torch.nn.functional as F

METHODS = ("mean", "cls", "last")
# llama.cpp's `llama_pooling_type` values as written in `<arch>.pooling_type`.
GGUF_POOLING = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}


def default_pooling(meta: dict[str, Any], encoder: bool) -> str:
    """The pooling a model's metadata asks for (its family's default when it names none)."""
    arch = meta.get("general.architecture", "")
    value = meta.get(f"{arch}.pooling_type")
    fallback = "mean" if encoder else "last"
    if value is None:
        return fallback
    name = GGUF_POOLING.get(int(value))
    if name is None:
        raise ValueError(f"unknown {arch}.pooling_type {value} in the GGUF metadata")
    if name == "rank":
        raise ValueError("this model is a reranker (pooling_type rank): it makes no embeddings")
    # "none" asks for per-token vectors; one vector per input needs a pooling, so use the default.
    return fallback if name == "none" else name


def check_method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"pooling must be one of {', '.join(METHODS)}, not {method!r}")
    return method


def pool(hidden: torch.Tensor, method: str) -> torch.Tensor:
    """One vector [dim] from the hidden states [n, dim] of one sequence."""
    check_method(method)
    if method == "mean":
        return hidden.mean(dim=0)
    return hidden[0] if method == "cls" else hidden[-1]


def normalize(v: torch.Tensor) -> torch.Tensor:
    """L2-normalised along the last dim (a zero vector stays zero)."""
    return F.normalize(v, p=2.0, dim=-1)
