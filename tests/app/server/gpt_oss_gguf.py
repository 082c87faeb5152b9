"""A tiny random-weight gpt-oss GGUF that speaks harmony: the synthetic gpt-oss of
tests/engine/test_gpt_oss.py with a byte-level vocabulary plus gpt-oss's special tokens and the
real gpt-oss chat template (tests/data/templates). Its text is noise, but under a grammar it writes
harmony tool calls through the real tokenizer, template, engine and llguidance.
"""

from pathlib import Path

import numpy as np

from localllm.engine.tokenizer.pieces import gpt2_byte_decoder
from tests.engine.gguf_fixtures import write_gguf
from tests.engine.test_gpt_oss import META, VOCAB, _tensors

TEMPLATE = Path(__file__).parents[2] / "data" / "templates" / "gpt-oss-120b.jinja"
# gpt-oss's markers (o200k_harmony), as control tokens: the loader applies llama.cpp's gpt-oss
# rules to them (<|channel|> ... rendered, <|end|> not an end of generation).
SPECIALS = ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>",
            "<|start|>", "<|end|>", "<|message|>", "<|call|>")  # fmt: skip
CONTROL, NORMAL = 3, 1
CTX = 4096


def write_harmony_gguf(path: Path) -> Path:
    chars = sorted(gpt2_byte_decoder(), key=lambda c: gpt2_byte_decoder()[c])
    assert len(chars) == VOCAB  # the engine test's vocabulary width: one token per byte
    tokens = [*chars, "to", *SPECIALS]  # one merge: the reader wants a non-empty merge list
    n = len(tokens)
    t = _tensors()
    rng = np.random.default_rng(1)
    for name in ("token_embd.weight", "output.weight"):  # rows for the special tokens
        rows = t[name]
        extra = rng.standard_normal((n - VOCAB, rows.shape[1])).astype(np.float32)
        t[name] = np.concatenate([rows, extra / np.float32(np.sqrt(rows.shape[1]))])
    types = [NORMAL] * (VOCAB + 1) + [CONTROL] * len(SPECIALS)
    meta = {f"gpt-oss.{k}": _typed(v) for k, v in {**META, "context_length": CTX}.items()}
    meta["gpt-oss.vocab_size"] = np.uint32(n)
    meta.update(
        {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": "gpt-4o",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": np.array(types, np.int32),
            "tokenizer.ggml.merges": ["t o"],
            "tokenizer.ggml.bos_token_id": np.uint32(tokens.index("<|startoftext|>")),
            "tokenizer.ggml.eos_token_id": np.uint32(tokens.index("<|return|>")),
            "tokenizer.ggml.add_bos_token": False,
            "tokenizer.chat_template": TEMPLATE.read_text(),
        }
    )
    tensors = {k: v for k, v in t.items() if not isinstance(v, tuple)}
    for k, (raw, qt) in ((k, v) for k, v in t.items() if isinstance(v, tuple)):
        shape = _logical_shape(k)
        tensors[k] = (raw, qt, shape)
    return write_gguf(path, meta, tensors, arch="gpt-oss")


def _typed(v):
    if isinstance(v, bool | str):
        return v
    return np.float32(v) if isinstance(v, float) else np.uint32(v)


def _logical_shape(name: str) -> tuple[int, ...]:
    ne, eff, d = META["expert_count"], META["expert_feed_forward_length"], META["embedding_length"]
    return (ne, d, eff) if "down" in name else (ne, eff, d)
