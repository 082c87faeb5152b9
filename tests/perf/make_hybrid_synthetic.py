"""Random-weight GGUF files of real hybrid model shapes (LFM2-1.2B, Granite-4.0-H-Tiny and -Small),
for speed figures: `make_synthetic.py`'s valid random blocks and tokenizer copy, with the hybrids'
tensors (short convolutions, Mamba-2 mixers) and keys as llama.cpp's converter writes them.

Q4_K_M follows llama.cpp's mix loosely: projections Q4_K, attn_v / ffn_down(_exps) of the "more
bits" layers and the output head Q6_K; convolutions, norms, SSM A/D/dt and the router F32.

    python tests/perf/make_hybrid_synthetic.py --shape lfm2-1.2b -o /tmp/lfm2.gguf
    python tests/perf/make_hybrid_synthetic.py --shape granite-4.0-h-tiny -o /tmp/g4t.gguf
"""

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_synthetic import _BLOCK, _copy_tokenizer, _more_bits, random_rows, smollm2_path


@dataclass(frozen=True)
class Hybrid:
    arch: str  # lfm2, lfm2moe or granitehybrid
    n_layers: int
    attn: tuple[int, ...]  # attention layers; the rest recurrent
    dim: int
    n_heads: int
    n_kv_heads: int
    hidden: int  # dense FFN, or each expert's
    vocab: int
    n_expert: int = 0
    n_used: int = 0
    shared: int = 0  # granite's shared MLP
    d_inner: int = 0  # mamba: inner size, heads, groups, state, conv taps
    ssm_heads: int = 0
    groups: int = 1
    d_state: int = 0
    d_conv: int = 4
    n_dense: int = 0  # lfm2moe: leading layers with a dense FFN of `hidden`, experts of expert_ff
    expert_ff: int = 0


SHAPES = {
    # LiquidAI/LFM2-1.2B config.json: 16 layers (6 attention), hidden 2048, 32 / 8 heads,
    # block_ff_dim 12288 auto-adjusted to 8192, conv_L_cache 3, vocab 65536, tied output
    "lfm2-1.2b": Hybrid("lfm2", 16, (2, 5, 8, 10, 12, 14), 2048, 32, 8, 8192, 65536),
    # LiquidAI/LFM2-8B-A1B: 24 layers, hidden 2048, 32 / 8 heads, the first 2 layers dense (7168),
    # 32 experts (top 4) of 1792 after them, vocab 65536; its six attention layers' places are
    # taken as below (from memory of its config's layer_types, not checked: speed depends on the
    # count)
    "lfm2-8b-a1b": Hybrid(
        "lfm2moe",
        24,
        (2, 6, 10, 14, 18, 21),
        2048,
        32,
        8,
        7168,
        65536,
        n_expert=32,
        n_used=4,
        n_dense=2,
        expert_ff=1792,
    ),
    # ibm-granite/granite-4.0-h-tiny: 40 layers (attention at 5, 15, 25, 35), hidden 1536, 12 / 4
    # heads; Mamba-2 48 heads of 64, 1 group, state 128; 64 experts (top 6) of 512, shared 1024
    "granite-4.0-h-tiny": Hybrid(
        "granitehybrid",
        40,
        (5, 15, 25, 35),
        1536,
        12,
        4,
        512,
        100352,
        n_expert=64,
        n_used=6,
        shared=1024,
        d_inner=3072,
        ssm_heads=48,
        d_state=128,
    ),
    # ibm-granite/granite-4.0-h-small: hidden 4096, 32 / 8 heads, Mamba-2 128 heads of 64,
    # 72 experts (top 10) of 768, shared 4096
    "granite-4.0-h-small": Hybrid(
        "granitehybrid",
        40,
        (5, 15, 25, 35),
        4096,
        32,
        8,
        768,
        100352,
        n_expert=72,
        n_used=10,
        shared=4096,
        d_inner=8192,
        ssm_heads=128,
        d_state=128,
    ),
}


def tensor_plan(s: Hybrid) -> list[tuple[str, tuple[int, ...], QT]]:
    """(name, numpy dims, type) in file order; the last dim is a row."""
    hd = s.dim // s.n_heads
    out = [("token_embd.weight", (s.vocab, s.dim), QT.Q4_K)]
    for i in range(s.n_layers):
        p, more = f"blk.{i}.", QT.Q6_K if _more_bits(i, s.n_layers) else QT.Q4_K
        out.append((p + "attn_norm.weight", (s.dim,), QT.F32))
        if i in s.attn:
            out += [
                (p + "attn_q.weight", (s.n_heads * hd, s.dim), QT.Q4_K),
                (p + "attn_k.weight", (s.n_kv_heads * hd, s.dim), QT.Q4_K),
                (p + "attn_v.weight", (s.n_kv_heads * hd, s.dim), more),
                (p + "attn_output.weight", (s.dim, s.n_heads * hd), QT.Q4_K),
            ]
            if s.arch.startswith("lfm2"):
                out += [(p + "attn_q_norm.weight", (hd,), QT.F32)]
                out += [(p + "attn_k_norm.weight", (hd,), QT.F32)]
        elif s.arch.startswith("lfm2"):
            out += [
                (p + "shortconv.conv.weight", (s.dim, 3), QT.F32),
                (p + "shortconv.in_proj.weight", (3 * s.dim, s.dim), QT.Q4_K),
                (p + "shortconv.out_proj.weight", (s.dim, s.dim), QT.Q4_K),
            ]
        else:
            conv = s.d_inner + 2 * s.groups * s.d_state
            out += [
                (p + "ssm_in.weight", (s.d_inner + conv + s.ssm_heads, s.dim), QT.Q4_K),
                (p + "ssm_conv1d.weight", (conv, s.d_conv), QT.F32),
                (p + "ssm_conv1d.bias", (conv,), QT.F32),
                (p + "ssm_dt.bias", (s.ssm_heads,), QT.F32),
                (p + "ssm_a", (s.ssm_heads, 1), QT.F32),
                (p + "ssm_d", (s.ssm_heads, 1), QT.F32),
                (p + "ssm_norm.weight", (s.groups, s.d_inner // s.groups), QT.F32),
                (p + "ssm_out.weight", (s.dim, s.d_inner), QT.Q4_K),
            ]
        out.append((p + "ffn_norm.weight", (s.dim,), QT.F32))
        if s.n_expert and i >= s.n_dense:
            ne, ff = s.n_expert, s.expert_ff or s.hidden
            out += [
                (p + "ffn_gate_inp.weight", (ne, s.dim), QT.F32),
                (p + "ffn_gate_exps.weight", (ne, ff, s.dim), QT.Q4_K),
                (p + "ffn_up_exps.weight", (ne, ff, s.dim), QT.Q4_K),
                (p + "ffn_down_exps.weight", (ne, s.dim, ff), more),
            ]
            if s.arch == "lfm2moe":  # sigmoid routing's choice bias, no shared expert
                out += [(p + "exp_probs_b.bias", (ne,), QT.F32)]
            else:
                out += [
                    (p + "ffn_gate_shexp.weight", (s.shared, s.dim), QT.Q4_K),
                    (p + "ffn_up_shexp.weight", (s.shared, s.dim), QT.Q4_K),
                    (p + "ffn_down_shexp.weight", (s.dim, s.shared), more),
                ]
        else:
            out += [
                (p + "ffn_gate.weight", (s.hidden, s.dim), QT.Q4_K),
                (p + "ffn_up.weight", (s.hidden, s.dim), QT.Q4_K),
                (p + "ffn_down.weight", (s.dim, s.hidden), more),
            ]
    norm = "token_embd_norm.weight" if s.arch.startswith("lfm2") else "output_norm.weight"
    out.append((norm, (s.dim,), QT.F32))
    if s.arch == "granitehybrid":  # LFM2 ties its head to the embedding
        out.append(("output.weight", (s.vocab, s.dim), QT.Q6_K))
    return out


def _metadata(w: gguf.GGUFWriter, s: Hybrid) -> None:
    a = s.arch
    w.add_uint32("general.file_type", 15)  # MOSTLY_Q4_K_M
    w.add_string("general.name", f"synthetic-{a}-Q4_K_M")
    w.add_block_count(s.n_layers)
    lfm = a.startswith("lfm2")
    w.add_context_length(128000 if lfm else 1 << 20)
    w.add_embedding_length(s.dim)
    w.add_feed_forward_length(s.hidden)
    w.add_head_count(s.n_heads)
    w.add_head_count_kv([s.n_kv_heads if i in s.attn else 0 for i in range(s.n_layers)])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(1e6 if lfm else 10000.0)
    w.add_vocab_size(s.vocab)
    if lfm:
        w.add_uint32(f"{a}.shortconv.l_cache", 3)
    if a == "lfm2moe":
        w.add_expert_count(s.n_expert)
        w.add_expert_used_count(s.n_used)
        w.add_expert_feed_forward_length(s.expert_ff)
        w.add_uint32(f"{a}.leading_dense_block_count", s.n_dense)
        w.add_uint32(f"{a}.expert_gating_func", 2)  # sigmoid
    if lfm:
        return
    w.add_expert_count(s.n_expert)
    w.add_expert_used_count(s.n_used)
    w.add_uint32(f"{a}.expert_shared_feed_forward_length", s.shared)
    w.add_float32(f"{a}.attention.scale", 0.0078125)
    w.add_float32(f"{a}.embedding_scale", 12.0)
    w.add_float32(f"{a}.residual_scale", 0.22)
    w.add_float32(f"{a}.logit_scale", 6.0)
    w.add_bool(f"{a}.rope.scaling.finetuned", False)
    w.add_ssm_conv_kernel(s.d_conv)
    w.add_ssm_state_size(s.d_state)
    w.add_ssm_group_count(s.groups)
    w.add_ssm_inner_size(s.d_inner)
    w.add_ssm_time_step_rank(s.ssm_heads)


def _data(name: str, dims: tuple[int, ...], qt: QT, rng: np.random.Generator) -> np.ndarray:
    if qt == QT.F32:
        n = math.prod(dims)
        if name.endswith("ssm_a"):  # -exp(A_log), A in (1, 16): decays a state would have
            return -rng.uniform(1, 16, dims).astype(np.float32)
        if "conv" in name and name.endswith("weight"):
            return (rng.standard_normal(dims) / math.sqrt(dims[-1])).astype(np.float32)
        if name.endswith(("bias", "ssm_d")) or "gate_inp" in name:
            return (0.5 * rng.standard_normal(dims) / math.sqrt(max(1, n // dims[0]))).astype(
                np.float32
            )
        return (1.0 + 0.05 * rng.standard_normal(dims)).astype(np.float32)
    rows, k = math.prod(dims[:-1]), dims[-1]
    return random_rows(qt, rows, k, rng).reshape(*dims[:-1], -1)


def write_hybrid(path: Path, s: Hybrid, tokenizer_from: Path | None, seed: int = 0) -> int:
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, s.arch)
    _metadata(w, s)
    _copy_tokenizer(w, tokenizer_from, s.vocab)
    plan = tensor_plan(s)
    for name, dims, qt in plan:
        if qt == QT.F32:
            w.add_tensor_info(name, dims, np.dtype(np.float32), 4 * math.prod(dims), QT.F32)
        else:
            block, nbytes = _BLOCK[qt]
            bshape = (*dims[:-1], dims[-1] // block * nbytes)
            w.add_tensor_info(name, bshape, np.dtype(np.uint8), math.prod(bshape), qt)
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
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--tokenizer-from", type=Path, default=None, help="GGUF (SmolLM2 default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", type=Path, required=True)
    a = p.parse_args(argv)
    src = a.tokenizer_from or smollm2_path()
    n = write_hybrid(a.output, SHAPES[a.shape], src, a.seed)
    print(f"{a.output}: {a.shape} Q4_K_M, {n / 2**30:.2f} GiB of tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
