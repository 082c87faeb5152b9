"""Tiny runnable GGUFs of every model family, rewritten with chosen (hostile) metadata.

`base(family)` is one small valid model of each family in engine/models as (architecture,
metadata, tensors): the decoders carry a 256-token byte-level BPE vocabulary (so `localllm run`
can run them), bert a WordPiece one. The tensors come from the families' own test writers, read
back as raw ggml blocks. `write_variant` writes a base with keys set, replaced or removed, which is
how the hostile-hyperparameter tests and the fuzz test make their files.
"""

import functools
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType as VT

from localllm.engine.gguf import open_gguf
from tests.engine import family_goldens, tiny_models
from tests.engine.gguf_fixtures import GGUFValue, write_gguf
from tests.offload.tiny_moe import QWEN3MOE, write_moe_gguf

FAMILIES = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3moe",
    "gemma3",
    "phi3",
    "deepseek2",
    "gpt_oss",
    "bert",
    # llama.cpp-converted fixtures (tests/engine/family_goldens.py)
    "smollm3",
    "olmo2",
    "gemma2",
    "glm4moe",
    "lfm2",
    "lfm2moe",
    "granitehybrid",
    "qwen3next",
)
CONVERTED = (
    "smollm3", "olmo2", "gemma2", "glm4moe", "lfm2", "lfm2moe", "granitehybrid", "qwen3next",
)  # fmt: skip
DELETE = object()  # a `write_variant` value that removes the key
TOKENS = "tokenizer.ggml.tokens"


def byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes; id 255 is the merged token "ab"."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    chars = [chr(b) if b in keep else chr(next(extra)) for b in range(256)]
    return [*chars[:255], "ab"]


def _bpe_vocab() -> dict[str, Any]:
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        TOKENS: byte_tokens(),
        "tokenizer.ggml.token_type": np.ones(256, np.int32),
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }


def _bert_file(path: Path) -> Path:
    """A 2-layer BERT encoder with a 32-token WordPiece vocabulary (random weights)."""
    rng = np.random.default_rng(0)
    d, ff, v, ctx = 32, 64, 32, 64

    def w(*shape):
        return (rng.standard_normal(shape) / math.sqrt(shape[-1])).astype(np.float32)

    t = {
        "token_embd.weight": w(v, d),
        "token_types.weight": w(2, d),
        "position_embd.weight": w(ctx, d),
        "token_embd_norm.weight": np.ones(d, np.float32),
        "token_embd_norm.bias": np.zeros(d, np.float32),
    }
    for i in range(2):
        p = f"blk.{i}."
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            t[p + name + ".weight"] = w(d, d)
        t[p + "ffn_up.weight"], t[p + "ffn_down.weight"] = w(ff, d), w(d, ff)
        for name in ("attn_output_norm", "layer_output_norm"):
            t[p + name + ".weight"] = np.ones(d, np.float32)
            t[p + name + ".bias"] = np.zeros(d, np.float32)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words += ["▁" + c for c in "abcdefghijklmnopqrstuvwxyz!"]
    meta = {
        "bert.context_length": ctx,
        "bert.embedding_length": d,
        "bert.feed_forward_length": ff,
        "bert.block_count": 2,
        "bert.attention.head_count": 4,
        "bert.attention.layer_norm_epsilon": 1e-12,
        "bert.pooling_type": 1,
        "tokenizer.ggml.model": "bert",
        TOKENS: words,
        "tokenizer.ggml.token_type": np.array([3] * 5 + [1] * 27, np.int32),
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 3,
        "tokenizer.ggml.unknown_token_id": 1,
    }
    return write_gguf(path, meta, t, arch="bert")


def _family_file(family: str, d: Path) -> Path:
    path = d / f"{family}.gguf"
    if family in tiny_models.SPECS:
        return tiny_models.write_tiny_gguf(path, tiny_models.SPECS[family])
    if family == "qwen3moe":
        return write_moe_gguf(path, QWEN3MOE)
    if family == "bert":
        return _bert_file(path)
    if family in CONVERTED:
        shutil.copyfile(family_goldens.path(family), path)
        return path
    # the families whose tests keep their own tiny layout (imported lazily: they pull pytest)
    from tests.engine import test_deepseek2, test_gpt_oss

    if family == "deepseek2":
        return tiny_models.write_gguf(
            path, "deepseek2", test_deepseek2.META, test_deepseek2._tensors()
        )
    return tiny_models.write_gguf(path, "gpt-oss", test_gpt_oss.META, test_gpt_oss._tensors())


@functools.cache
def base(family: str) -> tuple[str, dict[str, Any], dict[str, tuple]]:
    """(architecture, metadata without general.architecture, {name: (raw, qtype, shape)})."""
    with tempfile.TemporaryDirectory() as d, open_gguf(_family_file(family, Path(d))) as g:
        meta = dict(g.metadata)
        arch = meta.pop("general.architecture")
        meta.pop("general.alignment", None)
        tensors = {}
        for name in g.tensors:
            w = g.weight(name)
            tensors[name] = (w.data.numpy().copy(), w.qtype, tuple(w.shape))
    if family != "bert" and "tokenizer.ggml.model" not in meta:
        meta.update(_bpe_vocab())
    return arch, meta, tensors


def flipped_token(family: str, index: int, byte: int = 0, bit: int = 7) -> GGUFValue:
    """The vocabulary of `family` with one bit of token `index` flipped, as raw bytes (the
    reference writer cannot encode the invalid UTF-8 a flip can make)."""
    tokens = [t.encode("utf-8", "surrogateescape") for t in base(family)[1][TOKENS]]
    b = bytearray(tokens[index])
    b[byte] ^= 1 << bit
    tokens[index] = bytes(b)
    return GGUFValue(tokens, VT.ARRAY, VT.STRING)


def hparam(family: str, name: str) -> str:
    """The full metadata key of hyperparameter `name` (e.g. "block_count") of `family`."""
    return f"{base(family)[0]}.{name}"


def write_variant(
    path: Path,
    family: str,
    meta: dict[str, Any] | None = None,
    tensors: dict[str, Any] | None = None,
) -> Path:
    """Write `family`'s base model with metadata keys set (DELETE removes one) and tensors
    replaced (DELETE removes one). Values as gguf_fixtures.write_gguf takes them."""
    arch, m, t = base(family)
    m, t = dict(m), dict(t)
    for key, value in (meta or {}).items():
        m.pop(key, None) if value is DELETE else m.__setitem__(key, value)
    for name, value in (tensors or {}).items():
        t.pop(name, None) if value is DELETE else t.__setitem__(name, value)
    return write_gguf(path, m, t, arch=arch)
