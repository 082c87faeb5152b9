"""Tiny random-weight MoE GGUFs (`qwen3moe`, Mixtral-style `llama`) written with GGUFWriter.

Tensor names and shapes follow llama.cpp's converter: `ffn_gate_inp` [n_expert, dim] and the
stacked `ffn_{gate,up}_exps` [n_expert, ff, dim], `ffn_down_exps` [n_expert, dim, ff] (numpy
order, outermost first), so each expert's slice is contiguous in the file.
"""

import math
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT


@dataclass(frozen=True)
class MoESpec:
    arch: str = "qwen3moe"
    n_layers: int = 2
    dim: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 32
    n_expert: int = 8
    n_used: int = 2
    expert_ff: int = 32
    vocab: int = 256
    context: int = 128
    rope_base: float = 1e6
    expert_qtype: QT = QT.F32  # Q8_0 / Q4_0 keep the experts quantized
    attn_qtype: QT = QT.F32  # Q8_0: the attention's linears too (the CPU's native decode step)
    tied: bool = True

    @property
    def expert_nbytes(self) -> int:
        """Bytes of all expert tensors in the file."""
        n = 3 * self.n_layers * self.n_expert * self.dim * self.expert_ff
        block, nb = gguf.GGML_QUANT_SIZES[self.expert_qtype]
        return n // block * nb


QWEN3MOE = MoESpec()
MIXTRAL = MoESpec(arch="llama", head_dim=16, rope_base=10000.0, tied=False)


def _tensors(spec: MoESpec, rng: np.random.Generator) -> dict[str, np.ndarray]:
    d, hd, ff, ne = spec.dim, spec.head_dim, spec.expert_ff, spec.n_expert

    def w(*shape):
        return rng.standard_normal(shape, dtype=np.float32) / np.float32(math.sqrt(shape[-1]))

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"token_embd.weight": w(spec.vocab, d), "output_norm.weight": norm(d)}
    if not spec.tied:
        t["output.weight"] = w(spec.vocab, d)
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = norm(d)
        t[p + "attn_q.weight"] = w(spec.n_heads * hd, d)
        t[p + "attn_k.weight"] = w(spec.n_kv_heads * hd, d)
        t[p + "attn_v.weight"] = w(spec.n_kv_heads * hd, d)
        if spec.arch == "qwen3moe":
            t[p + "attn_q_norm.weight"] = norm(hd)
            t[p + "attn_k_norm.weight"] = norm(hd)
        t[p + "attn_output.weight"] = w(d, spec.n_heads * hd)
        t[p + "ffn_norm.weight"] = norm(d)
        # a wide router spread makes top-k choices clear-cut (no near ties across engines)
        t[p + "ffn_gate_inp.weight"] = 3 * w(ne, d)
        t[p + "ffn_gate_exps.weight"] = w(ne, ff, d)
        t[p + "ffn_up_exps.weight"] = w(ne, ff, d)
        t[p + "ffn_down_exps.weight"] = w(ne, d, ff)
    return t


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def _q8_0(a: np.ndarray) -> np.ndarray:
    """Q8_0 blocks (f16 scale, 32 int8) of `a`, vectorised: faster than gguf-py's for big
    tensors; the dequantized values are what gguf-py and our kernels decode from the bytes."""
    b = a.reshape(-1, 32)
    d = (np.abs(b).max(1, keepdims=True) / 127).astype(np.float16)
    q = np.round(b / np.where(d == 0, 1, d).astype(np.float32)).clip(-127, 127).astype(np.int8)
    out = np.empty((b.shape[0], 34), np.uint8)
    out[:, :2] = d.view(np.uint8)
    out[:, 2:] = q.view(np.uint8)
    return out.reshape(*a.shape[:-1], a.shape[-1] // 32 * 34)


def write_moe_gguf(path: Path, spec: MoESpec = QWEN3MOE, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    a = spec.arch
    writer = gguf.GGUFWriter(str(path), a)
    writer.add_name(f"tiny-{a}-moe")
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    if spec.vocab == 256:  # byte-level vocabulary, so the app can run the model on text;
        # byte 0xFF gives its id to one merge ("he"): a vocabulary needs at least one
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-2")
        writer.add_token_list([*_byte_chars()[:255], "he"])
        writer.add_token_types([1] * 256)
        writer.add_token_merges(["h e"])
    ints = {
        "block_count": spec.n_layers,
        "context_length": spec.context,
        "embedding_length": spec.dim,
        "feed_forward_length": spec.expert_ff,
        "attention.head_count": spec.n_heads,
        "attention.head_count_kv": spec.n_kv_heads,
        "expert_count": spec.n_expert,
        "expert_used_count": spec.n_used,
        "vocab_size": spec.vocab,
        "rope.dimension_count": spec.head_dim,
    }
    if a == "qwen3moe":
        ints["expert_feed_forward_length"] = spec.expert_ff
    if spec.head_dim != spec.dim // spec.n_heads:
        ints["attention.key_length"] = ints["attention.value_length"] = spec.head_dim
    for key, value in ints.items():
        writer.add_uint32(f"{a}.{key}", value)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32(f"{a}.rope.freq_base", spec.rope_base)
    for name, arr in _tensors(spec, rng).items():
        attn = name.endswith(
            ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight")
        )
        if attn and spec.attn_qtype == QT.Q8_0:
            writer.add_tensor(name, _q8_0(arr), raw_dtype=QT.Q8_0)
        elif "_exps" in name and spec.expert_qtype != QT.F32:
            q8 = spec.expert_qtype == QT.Q8_0
            raw = _q8_0(arr) if q8 else gguf.quants.quantize(arr, spec.expert_qtype)
            writer.add_tensor(name, raw, raw_dtype=spec.expert_qtype)
        else:
            writer.add_tensor(name, arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def expert_layers_file(path, seed: int, layers: int = 2, fmt=None, n_expert: int = 6):
    """`layers` layers of `n_expert` random experts of `fmt` (default Q4_K gate/up, Q6_K down,
    dim = hidden = 256) in one file: per layer the stacked raw tensors and its ExpertLayout."""
    import torch

    from localllm.kernels.moe import ExpertFormat
    from localllm.kernels.quant import QuantType
    from localllm.offload.expert_source import ExpertLayout
    from localllm.offload.ranges import ByteRange
    from tests.perf.make_synthetic import random_rows

    fmt = fmt or ExpertFormat(QuantType.Q4_K, QuantType.Q4_K, QuantType.Q6_K, 256, 256)
    E, D, H = n_expert, fmt.dim, fmt.hidden
    types = (QT(int(fmt.gate)), QT(int(fmt.up)), QT(int(fmt.down)))
    rng = np.random.default_rng(seed)
    raws, layouts, pos = {}, {}, 0
    with open(path, "wb") as f:
        for layer in range(layers):
            parts = [
                np.stack([random_rows(types[0], H, D, rng) for _ in range(E)]),
                np.stack([random_rows(types[1], H, D, rng) for _ in range(E)]),
                np.stack([random_rows(types[2], D, H, rng) for _ in range(E)]),
            ]
            ranges = []
            for a in parts:
                f.write(a.tobytes())
                ranges.append(ByteRange(str(path), pos, a.nbytes))
                pos += a.nbytes
            shapes = tuple((a.shape[1], a.shape[2]) for a in parts)
            layouts[layer] = ExpertLayout(E, tuple(ranges), shapes, fmt)
            raws[layer] = [torch.from_numpy(a) for a in parts]
    return raws, layouts
