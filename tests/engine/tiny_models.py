"""Tiny random-weight GGUF models of every supported family (DESIGN §8), written with GGUFWriter.

Each `TinySpec` holds the hyper-parameters of one 2-4 layer model; `write_tiny_gguf` writes it
with the metadata keys llama.cpp reads for that family and tensors named and shaped as llama.cpp's
converter writes them. Weights are small gaussians scaled by 1/sqrt(fan_in) so activations and
logits stay O(1); norm weights are 1 + noise. `quant=True` stores embeddings and attention as
Q8_0 and the FFN as Q4_0 to exercise the keep-quant path.
"""

import math
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT


@dataclass(frozen=True)
class TinySpec:
    arch: str
    n_layers: int = 2
    dim: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    hidden: int = 128
    vocab: int = 256
    context: int = 128
    rope_base: float = 10000.0
    rope_dims: int | None = None  # partial rotary (phi3); None: the whole head
    tied: bool = False  # no output.weight: the head reuses token_embd
    qkv_bias: bool = False  # qwen2
    qk_norm: bool = False  # qwen3, gemma3
    window: int = 0  # gemma3 sliding window
    swa_pattern: int = 0  # gemma3: every swa_pattern-th layer is global
    softcap: float = 0.0  # gemma3 final logit soft-capping
    longrope_orig: int = 0  # phi3 LongRoPE: original context (factors written when > 0)
    extra_kv: dict = field(default_factory=dict)


SPECS = {
    "llama": TinySpec("llama", rope_base=500000.0),
    "qwen2": TinySpec("qwen2", tied=True, qkv_bias=True, rope_base=1e6),
    # head_dim != dim / heads, as in Qwen3-0.6B
    "qwen3": TinySpec("qwen3", head_dim=32, tied=True, qk_norm=True, rope_base=1e6),
    # layers 0, 1, 3 local (window 8), layer 2 global; head_dim != dim / heads as in 270M
    "gemma3": TinySpec(
        "gemma3",
        n_layers=4,
        n_kv_heads=1,
        head_dim=32,
        tied=True,
        qk_norm=True,
        window=8,
        swa_pattern=3,
        softcap=5.0,
        rope_base=1e6,
    ),
    "phi3": TinySpec("phi3", rope_dims=8),
    # LongRoPE: context 64 over an original 32 selects the long factors
    "phi3_longrope": TinySpec("phi3", rope_dims=8, context=64, longrope_orig=32),
}


def longrope_factors(spec: TinySpec) -> tuple[np.ndarray, np.ndarray]:
    """(long, short) per-frequency divisors, deterministic and distinct."""
    n = (spec.rope_dims or spec.head_dim) // 2
    i = np.arange(n, dtype=np.float32)
    return 1.0 + 0.5 * i, 1.0 + 0.05 * i


def longrope_attn_factor(spec: TinySpec) -> float:
    """The converter's sqrt(1 + ln(scale) / ln(orig)) for LongRoPE."""
    scale = spec.context / spec.longrope_orig
    return math.sqrt(1 + math.log(scale) / math.log(spec.longrope_orig))


def _tensors(spec: TinySpec, rng: np.random.Generator) -> dict[str, np.ndarray]:
    d, hd, ff = spec.dim, spec.head_dim, spec.hidden
    nq, nkv = spec.n_heads * hd, spec.n_kv_heads * hd

    def w(rows, cols):
        return (rng.standard_normal((rows, cols)) / math.sqrt(cols)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"token_embd.weight": w(spec.vocab, d), "output_norm.weight": norm(d)}
    if not spec.tied:
        t["output.weight"] = w(spec.vocab, d)
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = norm(d)
        if spec.arch == "phi3":
            t[p + "attn_qkv.weight"] = w(nq + 2 * nkv, d)
        else:
            t[p + "attn_q.weight"] = w(nq, d)
            t[p + "attn_k.weight"] = w(nkv, d)
            t[p + "attn_v.weight"] = w(nkv, d)
        if spec.qkv_bias:
            for name, n in (("attn_q", nq), ("attn_k", nkv), ("attn_v", nkv)):
                t[p + name + ".bias"] = (0.5 * rng.standard_normal(n)).astype(np.float32)
        if spec.qk_norm:
            t[p + "attn_q_norm.weight"] = norm(hd)
            t[p + "attn_k_norm.weight"] = norm(hd)
        t[p + "attn_output.weight"] = w(d, nq)
        t[p + "ffn_norm.weight"] = norm(d)
        if spec.arch == "phi3":
            t[p + "ffn_up.weight"] = w(2 * ff, d)
        else:
            t[p + "ffn_gate.weight"] = w(ff, d)
            t[p + "ffn_up.weight"] = w(ff, d)
        t[p + "ffn_down.weight"] = w(d, ff)
        if spec.arch == "gemma3":
            t[p + "post_attention_norm.weight"] = norm(d)
            t[p + "post_ffw_norm.weight"] = norm(d)
    if spec.longrope_orig:
        t["rope_factors_long.weight"], t["rope_factors_short.weight"] = longrope_factors(spec)
    return t


def _metadata(spec: TinySpec) -> dict[str, int | float]:
    a = spec.arch
    m = {
        f"{a}.block_count": spec.n_layers,
        f"{a}.context_length": spec.context,
        f"{a}.embedding_length": spec.dim,
        f"{a}.feed_forward_length": spec.hidden,
        f"{a}.attention.head_count": spec.n_heads,
        f"{a}.attention.head_count_kv": spec.n_kv_heads,
        f"{a}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{a}.rope.freq_base": spec.rope_base,
        f"{a}.vocab_size": spec.vocab,  # transformers reads the vocab size from here
    }
    if spec.head_dim != spec.dim // spec.n_heads:
        m[f"{a}.attention.key_length"] = spec.head_dim
        m[f"{a}.attention.value_length"] = spec.head_dim
    m[f"{a}.rope.dimension_count"] = spec.rope_dims or spec.head_dim
    if spec.window:
        m[f"{a}.attention.sliding_window"] = spec.window
        m[f"{a}.attention.sliding_window_pattern"] = spec.swa_pattern
    if spec.softcap:
        m[f"{a}.final_logit_softcapping"] = spec.softcap
    if spec.longrope_orig:
        m[f"{a}.rope.scaling.original_context_length"] = spec.longrope_orig
        m[f"{a}.rope.scaling.attn_factor"] = longrope_attn_factor(spec)
    m.update(spec.extra_kv)
    return m


def _qtype(name: str, arr: np.ndarray, quant: bool) -> QT:
    if not quant or arr.ndim != 2:
        return QT.F32
    return QT.Q4_0 if ".ffn_" in name else QT.Q8_0


def write_tiny_gguf(
    path: Path, spec: TinySpec, quant: bool = False, seed: int = 0, drop: tuple[str, ...] = ()
) -> Path:
    """Write `spec` as a GGUF at `path` (F32, or Q8_0/Q4_0 linear weights when `quant`).

    `drop` leaves the named tensors out (to test the loader's errors).
    """
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), spec.arch)
    writer.add_name(f"tiny-{spec.arch}")
    # Special ids keep transformers' config defaults (e.g. phi3's pad 32000) inside the vocab.
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    for key, value in _metadata(spec).items():
        if isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    for name, arr in _tensors(spec, rng).items():
        if name in drop:
            continue
        qt = _qtype(name, arr, quant)
        if qt == QT.F32:
            writer.add_tensor(name, arr)
        else:
            writer.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_gguf(path: Path, arch: str, meta: dict, tensors: dict[str, np.ndarray]) -> Path:
    """A GGUF of `arch` with the given `{arch}.*` metadata (ints as uint32, floats as float32,
    bools as bool) and tensors: float32 arrays, or (raw uint8 blocks, QT) pairs."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    for key, value in meta.items():
        if isinstance(value, bool):
            writer.add_bool(f"{arch}.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        elif isinstance(value, str):
            writer.add_string(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", value)
    for name, arr in tensors.items():
        if isinstance(arr, tuple):
            writer.add_tensor(name, arr[0], raw_dtype=arr[1])
        else:
            writer.add_tensor(name, arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
