"""Will a model fit? Weight bytes plus a KV-cache estimate against the memory available now.

The KV estimate reads the GGUF header only (layers, KV heads, head size) and assumes an f16 cache
over min(model context, `DEFAULT_CONTEXT`) tokens, which is what a chat session typically uses.
"""

from dataclasses import dataclass
from pathlib import Path

from localllm.app.hub.library import LocalModel, scan_library
from localllm.engine.gguf import GGUFError, open_gguf

DEFAULT_CONTEXT = 8192
OVERHEAD = 256 * 1024 * 1024  # activations, tokenizer, runtime: a flat allowance
TIGHT = 0.85  # above this share of available memory the system will likely swap


@dataclass(frozen=True)
class Fit:
    needed: int
    available: int
    verdict: str  # "fits", "tight" or "too big"


def kv_bytes(path: Path, context: int | None = None) -> int | None:
    """f16 K+V bytes for min(context, DEFAULT_CONTEXT) tokens, or None when the header lacks it."""
    try:
        with open_gguf(path) as m:
            arch = m.architecture
            if not arch:
                return None
            layers = m.get(f"{arch}.block_count")
            heads = m.get(f"{arch}.attention.head_count")
            kv_heads = m.get(f"{arch}.attention.head_count_kv", heads)
            embd = m.get(f"{arch}.embedding_length")
            ctx = context or m.get(f"{arch}.context_length") or DEFAULT_CONTEXT
            k_dim = m.get(f"{arch}.attention.key_length")
            v_dim = m.get(f"{arch}.attention.value_length")
    except (GGUFError, OSError):
        return None
    if isinstance(kv_heads, list):  # per-layer counts (some hybrids): take the largest
        kv_heads = max(kv_heads)
    if not all(isinstance(x, int) and x > 0 for x in (layers, heads, kv_heads, embd)):
        return None
    k_dim = k_dim or embd // heads
    v_dim = v_dim or embd // heads
    tokens = min(ctx, DEFAULT_CONTEXT)
    return layers * kv_heads * (k_dim + v_dim) * tokens * 2


def fit(model_bytes: int, kv: int | None, available: int) -> Fit:
    needed = model_bytes + (kv or 0) + OVERHEAD
    if needed <= TIGHT * available:
        verdict = "fits"
    elif needed <= available:
        verdict = "tight"
    else:
        verdict = "too big"
    return Fit(needed, available, verdict)


@dataclass(frozen=True)
class LibraryEntry:
    model: LocalModel
    fit: Fit


def scan_entries(cache_dir: Path, dirs: tuple[Path, ...], available: int) -> list[LibraryEntry]:
    """The library with a fit verdict per model (reads GGUF headers: call from a thread)."""
    return [
        LibraryEntry(m, fit(m.size, kv_bytes(m.path, m.context_length), available))
        for m in scan_library(cache_dir, dirs)
    ]
