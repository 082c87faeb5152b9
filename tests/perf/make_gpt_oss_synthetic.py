"""A gpt-oss-shaped random-weight GGUF for speed measurements (not a test): OpenAI's
gpt-oss-20b (24 layers, hidden 2880, 64 query / 8 KV heads of 64, 32 experts of 2880, 4 per
token, sliding window 128 on every other layer, YaRN x32 over 4,096, vocabulary 201,088) in the
types of ggml-org's gpt-oss-20b-mxfp4.gguf: experts MXFP4, attention and embeddings Q8_0,
norms, biases, sinks and the router F32 (~12 GB; `--layers` fewer). A byte-level tokenizer
padded to the vocabulary (make_synthetic's): speed depends on the shapes and types alone.

    python tests/perf/make_gpt_oss_synthetic.py -o /tmp/gpt-oss-20b.gguf [--layers 24]
"""

import argparse
import math
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_synthetic import _copy_tokenizer, random_rows, write_plan

LAYERS, DIM, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, USED, EXPERT_FF = 24, 2880, 64, 8, 64, 32, 4, 2880
VOCAB, WINDOW, CONTEXT = 201088, 128, 131072


def plan(layers: int) -> list:
    """(name, logical dims, type) of every tensor: dims innermost last, as make_synthetic."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    out = [("token_embd.weight", (VOCAB, DIM), QT.Q8_0)]
    for i in range(layers):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", DIM, QT.F32)]
        for name, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            out += [
                (p + name + ".weight", (rows, DIM), QT.Q8_0),
                (p + name + ".bias", rows, QT.F32),
            ]
        out += [
            (p + "attn_output.weight", (DIM, q), QT.Q8_0),
            (p + "attn_output.bias", DIM, QT.F32),
            (p + "attn_sinks.weight", HEADS, QT.F32),
            (p + "post_attention_norm.weight", DIM, QT.F32),
            (p + "ffn_gate_inp.weight", (EXPERTS, DIM), QT.F32),
            (p + "ffn_gate_inp.bias", EXPERTS, QT.F32),
        ]
        for name, rows, k in (
            ("gate", EXPERT_FF, DIM),
            ("up", EXPERT_FF, DIM),
            ("down", DIM, EXPERT_FF),
        ):
            out += [(p + f"ffn_{name}_exps.weight", (EXPERTS, rows, k), QT.MXFP4),
                    (p + f"ffn_{name}_exps.bias", (EXPERTS, rows), QT.F32)]  # fmt: skip
    return [*out, ("output_norm.weight", DIM, QT.F32), ("output.weight", (VOCAB, DIM), QT.Q8_0)]


def mxfp4_rows(rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, k / 32 * 17] of MXFP4 blocks: random codes, E8M0 scales 2^-9 and 2^-8 (the
    doubled E2M1 codes' std ~5.7 times that: ~1 / sqrt(2880), as a trained matrix's)."""
    raw = rng.integers(0, 256, size=(rows * (k // 32), 17), dtype=np.uint8)
    raw[:, 0] = rng.integers(119, 121, raw.shape[0], dtype=np.uint8)
    return raw.reshape(rows, -1)


def data(name: str, dims, qt: QT, rng: np.random.Generator) -> np.ndarray:
    if qt == QT.F32:
        shape = (dims,) if isinstance(dims, int) else dims
        if name.endswith("norm.weight"):
            return (1.0 + 0.05 * rng.standard_normal(shape)).astype(np.float32)
        if name.endswith("ffn_gate_inp.weight"):  # a wide spread: clear-cut top-k choices
            return (3 * rng.standard_normal(shape) / math.sqrt(shape[-1])).astype(np.float32)
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)  # biases, sinks
    rows, k = math.prod(dims[:-1]), dims[-1]
    if qt == QT.MXFP4:
        out = np.concatenate(
            [mxfp4_rows(min(2880, rows - r), k, rng) for r in range(0, rows, 2880)]
        )
    else:
        out = np.concatenate(
            [random_rows(qt, min(8192, rows - r), k, rng) for r in range(0, rows, 8192)]
        )
    return out.reshape(*dims[:-1], -1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-o", "--output", type=Path, required=True)
    p.add_argument("--layers", type=int, default=LAYERS)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    rng = np.random.default_rng(a.seed)
    w = gguf.GGUFWriter(a.output, "gpt-oss")
    w.add_string("general.name", "synthetic-gpt-oss-20b-mxfp4")
    w.add_uint32("general.file_type", 38)  # LLAMA_FTYPE_MOSTLY_MXFP4_MOE
    w.add_block_count(a.layers)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(DIM)
    w.add_feed_forward_length(EXPERT_FF)
    w.add_expert_feed_forward_length(EXPERT_FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_sliding_window(WINDOW)
    w.add_rope_freq_base(150000.0)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_expert_count(EXPERTS)
    w.add_expert_used_count(USED)
    w.add_vocab_size(VOCAB)
    _copy_tokenizer(w, None, VOCAB)
    total = write_plan(w, plan(a.layers), lambda n, d, q: data(n, d, q, rng))
    print(f"{a.output}: {total / 2**30:.2f} GiB of tensors, {a.layers} layers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
