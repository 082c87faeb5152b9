"""Random-weight Gemma-3-4B- and Qwen2.5-VL-7B-shaped GGUF pairs (a Q4_K_M text model + its F16
mmproj) that both llama.cpp's libmtmd and `localllm --mmproj` load, for the encode-time and
time-to-first-token comparison on the GPU (tests/perf/gpu_vision_mtmd.sh).

Keys and tensor names are those llama.cpp's `convert_hf_to_gguf.py` (and `--mmproj`) writes,
checked against the converted test fixtures tests/data/vision/{gemma3,qwen25vl}-text.gguf and
mmproj-{gemma3,qwen25vl}.gguf. The text model's tokenizer is the fixture's (a tiny BPE with the
family's special tokens and chat template: `<start_of_image>` / `<image_soft_token>`,
`<|vision_start|>` / `<|image_pad|>`), padded with control tokens to the real vocabulary, so the
embedding and the head have their real sizes.

`gemma3-4b`: text gemma3 (google/gemma-3-4b-it): 34 layers, 2560 wide, 8 / 4 heads of 256,
FFN 10240, vocab 262208, sliding window 1024 (local rope base 10000, global 1e6), tied head
(Q6_K under Q4_K_M, as llama.cpp quantizes a tied embedding); the linear rope scaling (x8) of
its global layers is not written (neither program's time depends on it). mmproj `gemma3`:
SigLIP so400m, 27 blocks, 1152 wide, 16 heads, MLP 4304, 896-px images in 14-px patches (4096),
pooled by 4 to 256 tokens, `mm.input_projection` to 2560.
`qwen25vl-7b`: text qwen2vl (Qwen/Qwen2.5-VL-7B-Instruct): 28 layers, 3584 wide, 28 / 4 heads
of 128, FFN 18944, vocab 152064, q/k/v biases, M-RoPE sections 16/24/24, untied head. mmproj
`qwen2.5vl_merger`: 32 blocks, 1280 wide, 16 heads, SwiGLU MLP 3420, RMS norms, 14-px patches
over 2 frames (two patch-embedding halves), window attention with full attention every 8th
block (n_wa_pattern 8), patch merger 5120 -> 5120 -> 3584. Its pixel bounds are written as
`clip.vision.image_min_pixels` / `image_max_pixels` = the model's preprocessor_config.json (3136,
12845056), which localllm reads and llama.cpp ignores for this projector (it bounds Qwen images
to 8-4096 tokens): without them localllm would fall back to the processor class's default (1280
tokens: a 1024x1024 image -> 980x980, 1,225 tokens) while llama.cpp takes 1036x1036 (1,369); with
them both encode the same 1,369 tokens. (llama.cpp's converter does not write the keys.)

Memory holds one tensor at a time (`make_synthetic.write_plan` for the text model).

    python tests/perf/make_synthetic_vlm_big.py --shape gemma3-4b -o /tmp/vlm [--part text|mmproj]
        [--text-layers N] [--vision-layers N] [--seed 0]
    # writes /tmp/vlm/gemma3-4b-text.gguf and /tmp/vlm/gemma3-4b-mmproj.gguf
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
from make_synthetic import _copy_tokenizer, _more_bits, random_rows, write_plan

DATA = Path(__file__).resolve().parents[1] / "data" / "vision"


@dataclass(frozen=True)
class Pair:
    arch: str  # the text model's general.architecture
    layers: int
    dim: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    context: int
    tokenizer: str  # the fixture whose tokenizer (and chat template) the text model gets
    projector: str
    v_layers: int
    v_dim: int
    v_heads: int
    v_ffn: int
    image_size: int
    patch: int


# fmt: off
SHAPES = {
    "gemma3-4b": Pair("gemma3", 34, 2560, 8, 4, 256, 10240, 262208, 131072, "gemma3-text.gguf",
                      "gemma3", 27, 1152, 16, 4304, 896, 14),
    "qwen25vl-7b": Pair("qwen2vl", 28, 3584, 28, 4, 128, 18944, 152064, 128000,
                        "qwen25vl-text.gguf", "qwen2.5vl_merger", 32, 1280, 16, 3420, 560, 14),
}
# fmt: on

Plan = list[tuple[str, int | tuple[int, ...], QT]]


def text_plan(s: Pair) -> Plan:
    """Q4_K_M as llama.cpp mixes it: Q6_K for attn_v / ffn_down of the "more bits" layers and
    for the head (gemma3's tied embedding); F32 norms and biases."""
    d, q, kv, f = s.dim, s.heads * s.head_dim, s.kv_heads * s.head_dim, s.ffn
    gemma = s.arch == "gemma3"
    out: Plan = [("token_embd.weight", (s.vocab, d), QT.Q6_K if gemma else QT.Q4_K)]
    for i in range(s.layers):
        p, more = f"blk.{i}.", QT.Q6_K if _more_bits(i, s.layers) else QT.Q4_K
        out += [(p + "attn_norm.weight", d, QT.F32)]
        for name, rows, qt in (
            ("attn_q", q, QT.Q4_K),
            ("attn_k", kv, QT.Q4_K),
            ("attn_v", kv, more),
        ):
            out += [(p + name + ".weight", (rows, d), qt)]
            if not gemma:
                out += [(p + name + ".bias", rows, QT.F32)]
        out += [(p + "attn_output.weight", (d, q), QT.Q4_K)]
        if gemma:
            out += [(p + "attn_q_norm.weight", s.head_dim, QT.F32)]
            out += [(p + "attn_k_norm.weight", s.head_dim, QT.F32)]
            out += [(p + "post_attention_norm.weight", d, QT.F32)]
        out += [(p + "ffn_norm.weight", d, QT.F32)]
        out += [(p + "ffn_gate.weight", (f, d), QT.Q4_K), (p + "ffn_up.weight", (f, d), QT.Q4_K)]
        out += [(p + "ffn_down.weight", (d, f), more)]
        if gemma:
            out += [(p + "post_ffw_norm.weight", d, QT.F32)]
    out += [("output_norm.weight", d, QT.F32)]
    if not gemma:
        out += [("output.weight", (s.vocab, d), QT.Q6_K)]
    return out


def write_text(path: Path, s: Pair, seed: int) -> int:
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, s.arch)
    a = s.arch
    w.add_uint32("general.file_type", 15)  # MOSTLY_Q4_K_M
    w.add_string("general.name", f"synthetic-{a}-Q4_K_M")
    w.add_block_count(s.layers)
    w.add_context_length(s.context)
    w.add_embedding_length(s.dim)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    if a == "gemma3":
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
        w.add_uint32(f"{a}.attention.sliding_window", 1024)
        w.add_float32(f"{a}.rope.freq_base_swa", 10000.0)
    else:
        w.add_array(f"{a}.rope.dimension_sections", [16, 24, 24, 0])
    _copy_tokenizer(w, DATA / s.tokenizer, s.vocab)
    return write_plan(w, text_plan(s), lambda n, d, qt: _data(n, d, qt, rng))


def mmproj_plan(s: Pair) -> Plan:
    """(name, numpy dims, type) in the converter's order; F16 matrices, F32 the rest."""
    d, f, p, F16, F32 = s.v_dim, s.v_ffn, s.patch, QT.F16, QT.F32
    out: Plan = []
    if s.projector == "gemma3":
        n_pos = (s.image_size // p) ** 2
        out += [
            ("mm.input_projection.weight", (d, s.dim), F16),
            ("mm.soft_emb_norm.weight", d, F32),
        ]
        out += [("v.patch_embd.bias", d, F32), ("v.patch_embd.weight", (d, 3, p, p), F32)]
        out += [("v.position_embd.weight", (n_pos, d), F32)]
    for i in range(s.v_layers):
        b = f"v.blk.{i}."
        if s.projector == "gemma3":
            out += [(b + "ln1.bias", d, F32), (b + "ln1.weight", d, F32)]
            out += [(b + "ln2.bias", d, F32), (b + "ln2.weight", d, F32)]
            out += [(b + "ffn_up.bias", f, F32), (b + "ffn_up.weight", (f, d), F16)]
            out += [(b + "ffn_down.bias", d, F32), (b + "ffn_down.weight", (d, f), F16)]
            for t in ("attn_k", "attn_out", "attn_q", "attn_v"):
                out += [(b + t + ".bias", d, F32), (b + t + ".weight", (d, d), F16)]
        else:
            out += [(b + "attn_out.bias", d, F32), (b + "attn_out.weight", (d, d), F16)]
            out += [(b + f"attn_{t}.bias", d, F32) for t in "qkv"]
            out += [(b + f"attn_{t}.weight", (d, d), F16) for t in "qkv"]
            out += [(b + "ffn_down.bias", d, F32), (b + "ffn_down.weight", (d, f), F16)]
            out += [(b + "ffn_gate.bias", f, F32), (b + "ffn_gate.weight", (f, d), F16)]
            out += [(b + "ffn_up.bias", f, F32), (b + "ffn_up.weight", (f, d), F16)]
            out += [(b + "ln1.weight", d, F32), (b + "ln2.weight", d, F32)]
    if s.projector == "gemma3":
        out += [("v.post_ln.bias", d, F32), ("v.post_ln.weight", d, F32)]
    else:
        m = 4 * d  # 2 x 2 patches merged
        out += [("v.post_ln.weight", d, F32)]
        out += [("mm.0.bias", m, F32), ("mm.0.weight", (m, m), F16)]
        out += [("mm.2.bias", s.dim, F32), ("mm.2.weight", (s.dim, m), F16)]
        out += [
            ("v.patch_embd.weight", (d, 3, p, p), F16),
            ("v.patch_embd.weight.1", (d, 3, p, p), F16),
        ]
    return out


def write_mmproj(path: Path, s: Pair, seed: int) -> int:
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "clip")
    w.add_type("mmproj")
    w.add_string("general.name", f"synthetic-{s.projector}-F16")
    w.add_uint32("general.file_type", 1)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_uint32("clip.vision.projection_dim", s.dim)
    w.add_uint32("clip.vision.image_size", s.image_size)
    w.add_uint32("clip.vision.patch_size", s.patch)
    w.add_uint32("clip.vision.embedding_length", s.v_dim)
    w.add_uint32("clip.vision.feed_forward_length", s.v_ffn)
    w.add_uint32("clip.vision.block_count", s.v_layers)
    w.add_uint32("clip.vision.attention.head_count", s.v_heads)
    if s.projector == "gemma3":
        w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
        w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    else:  # CLIP's, as Qwen2.5-VL's preprocessor_config.json
        w.add_array("clip.vision.image_mean", [0.48145466, 0.4578275, 0.40821073])
        w.add_array("clip.vision.image_std", [0.26862954, 0.26130258, 0.27577711])
    w.add_string("clip.projector_type", s.projector)
    if s.projector == "gemma3":
        w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
        w.add_bool("clip.use_gelu", True)
        w.add_uint32("clip.vision.projector.scale_factor", 4)  # 64 x 64 patches -> 16 x 16
    else:
        w.add_bool("clip.use_silu", True)
        w.add_uint32("clip.vision.n_wa_pattern", 8)  # fullatt_block_indexes 7, 15, 23, 31
        # the model's preprocessor_config.json bounds (see the module docstring)
        w.add_uint32("clip.vision.image_min_pixels", 3136)
        w.add_uint32("clip.vision.image_max_pixels", 12845056)
        w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    return _write_float(w, mmproj_plan(s), rng)


def _write_float(w: gguf.GGUFWriter, plan: Plan, rng: np.random.Generator) -> int:
    """`write_plan` for F16/F32 tensors (which it does not take): infos, then the data one
    tensor at a time."""
    dtypes = {QT.F16: np.dtype(np.float16), QT.F32: np.dtype(np.float32)}
    for name, dims, qt in plan:
        shape = (dims,) if isinstance(dims, int) else dims
        w.add_tensor_info(name, shape, dtypes[qt], math.prod(shape) * dtypes[qt].itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total = 0
    for name, dims, qt in plan:
        out = _data(name, dims, qt, rng)
        total += out.nbytes
        w.write_tensor_data(out)
        del out
    w.close()
    return total


def _data(name: str, dims, qt: QT, rng: np.random.Generator) -> np.ndarray:
    """Norms around 1, biases small, F16/F32 matrices N(0, 1/fan_in), K-quant rows random."""
    if isinstance(dims, int):
        if name.endswith(".bias"):
            return (0.02 * rng.standard_normal(dims)).astype(np.float32)
        return (1.0 + 0.05 * rng.standard_normal(dims)).astype(np.float32)
    k = math.prod(dims[1:])
    if name == "mm.input_projection.weight":  # stored [vision, text]: the fan-in is dims[0]
        k = dims[0]
    if "position_embd" in name:
        k = 2500  # std 0.02
    if qt in (QT.F16, QT.F32):
        dt = np.float16 if qt == QT.F16 else np.float32
        out = rng.standard_normal(dims, dtype=np.float32)
        out *= 1 / math.sqrt(k)
        return out.astype(dt, copy=False)
    rows, k = math.prod(dims[:-1]), dims[-1]
    out = np.concatenate(
        [random_rows(qt, min(8192, rows - r), k, rng) for r in range(0, rows, 8192)]
    )
    return out.reshape(*dims[:-1], -1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--part", choices=("both", "text", "mmproj"), default="both")
    p.add_argument("--text-layers", type=int, default=None, help="fewer text layers")
    p.add_argument("--vision-layers", type=int, default=None, help="fewer vision blocks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", type=Path, required=True, help="folder for the pair")
    a = p.parse_args(argv)
    s = SHAPES[a.shape]
    s = Pair(**{**s.__dict__, "layers": a.text_layers or s.layers,
                "v_layers": a.vision_layers or s.v_layers})  # fmt: skip
    a.output.mkdir(parents=True, exist_ok=True)
    if a.part in ("both", "text"):
        path = a.output / f"{a.shape}-text.gguf"
        n = write_text(path, s, a.seed)
        print(f"{path}: {s.arch} {s.layers} layers Q4_K_M, {n / 2**30:.2f} GiB of tensors")
    if a.part in ("both", "mmproj"):
        path = a.output / f"{a.shape}-mmproj.gguf"
        n = write_mmproj(path, s, a.seed + 1)
        print(f"{path}: {s.projector} {s.v_layers} blocks F16, {n / 2**30:.2f} GiB of tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
