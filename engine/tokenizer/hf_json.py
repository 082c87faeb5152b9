"""A Hugging Face folder's tokenizer: `tokenizer.json` encoded by the `tokenizers` library itself,
with the special tokens, BOS/EOS switches and chat template of `tokenizer_config.json`.

`hf_vocab` fills the same `Vocab` a GGUF gives (token texts, attribute flags, special ids), the
way llama.cpp's converter reads these files: added tokens marked special are control tokens, the
others user-defined; ids the model's embedding has past the tokenizer are `[PAD{i}]` unused
tokens. Decoding goes through the engine's own piece table from that vocabulary (byte-level or
SentencePiece-style texts); encoding is `HFEncoder`: the library on the file as transformers
runs it, which avoids guessing a GGUF pre-tokenizer name. End-of-generation ids add
generation_config.json's `eos_token_id`s (Llama 3 stops on several).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from localllm.engine.tokenizer.attrs import Attr
from localllm.engine.tokenizer.special_names import apply_name_rules
from localllm.engine.tokenizer.vocab import Vocab, VocabError

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"


class HFEncoder:
    """Text -> ids with the `tokenizers` library (two instances: with parse_special False,
    special tokens written in the text are plain text, as `encode_special_tokens` makes them)."""

    def __init__(self, text: str) -> None:
        self._parse = HFTokenizer.from_str(text)
        self._plain = HFTokenizer.from_str(text)
        self._plain.encode_special_tokens = True

    def encode(self, text: str, parse_special: bool) -> list[int]:
        hf = self._parse if parse_special else self._plain
        # the batch call: `tokenizers` lets go of the GIL only there (see backend.Encoder)
        batch = getattr(hf, "encode_batch_fast", hf.encode_batch)
        return batch([text], add_special_tokens=False)[0].ids


def _read(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise VocabError(f"{path.name}: cannot read ({e})") from None


def _token_text(value: Any) -> str | None:
    """A special token in tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if type(value) is int:
        return [value]
    if isinstance(value, list):
        return [v for v in value if type(v) is int]
    return []


def _chat_template(folder: Path, config: dict) -> str | None:
    path = folder / TEMPLATE_FILE
    if path.is_file():
        return path.read_text(encoding="utf-8")
    t = config.get("chat_template")
    if isinstance(t, list):  # named templates: the default one
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        t = named.get("default") or next(iter(named.values()), None)
    return t if isinstance(t, str) and t else None


def _kind(data: dict) -> str:
    """ "gpt2" (byte-level BPE) or "llama" (SentencePiece-style texts with ▁ and <0xNN>)."""
    model = data.get("model") or {}
    kind = model.get("type")
    if kind == "BPE":
        text = json.dumps([data.get("pre_tokenizer"), data.get("decoder")])
        return "gpt2" if "ByteLevel" in text else "llama"
    if kind == "Unigram":
        return "llama"
    raise VocabError(f"{TOKENIZER_FILE}: unsupported tokenizer model {kind!r} (BPE, Unigram)")


def _space_prefix(data: dict) -> bool:
    """Whether decoding drops the space the normalizer put before the text (SentencePiece)."""
    text = json.dumps([data.get("normalizer"), data.get("pre_tokenizer"), data.get("decoder")])
    if '"Prepend"' in text:
        return True
    meta = '"Metaspace"' in text and '"prepend_scheme": "never"' not in text
    return meta and '"add_prefix_space": false' not in text


def hf_vocab(folder: Path, n_vocab: int) -> tuple[Vocab, HFEncoder]:
    """The vocabulary and encoder of a folder whose model has `n_vocab` embedding rows."""
    path = folder / TOKENIZER_FILE
    if not path.is_file():
        raise VocabError(f"no {TOKENIZER_FILE} (the folder has no tokenizer we read)")
    text = path.read_text(encoding="utf-8")
    try:
        hf = HFTokenizer.from_str(text)
    except Exception as e:  # `tokenizers` raises plain Exception for a file it refuses
        raise VocabError(f"{TOKENIZER_FILE}: {e}") from None
    data = json.loads(text)
    config = _read(folder / CONFIG_FILE) if (folder / CONFIG_FILE).is_file() else {}
    gen = folder / "generation_config.json"
    gen_config = _read(gen) if gen.is_file() else {}
    model_config = _read(folder / "config.json") if (folder / "config.json").is_file() else {}
    kind = _kind(data)
    table = hf.get_vocab(with_added_tokens=True)
    top = max(table.values(), default=-1) + 1
    if top > n_vocab:
        raise VocabError(
            f"{TOKENIZER_FILE} has ids up to {top - 1} but the model's embedding has {n_vocab} rows"
        )
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    attrs = np.full(n_vocab, int(Attr.UNUSED), np.int32)
    for tok, i in table.items():
        tokens[i] = tok
        attrs[i] = int(Attr.NORMAL)
    unk = (data.get("model") or {}).get("unk_token")
    if isinstance(unk, str) and unk in table:
        attrs[table[unk]] = int(Attr.UNKNOWN)
    for added in data.get("added_tokens") or ():
        i, content = added.get("id"), added.get("content")
        if type(i) is not int or not isinstance(content, str) or not 0 <= i < n_vocab:
            continue
        if added.get("special"):
            attrs[i] = int(Attr.CONTROL)
        else:  # the converter's rule: a user-defined token's ▁ is a space
            attrs[i] = int(Attr.USER_DEFINED)
            tokens[i] = content.replace("▁", " ") if kind == "llama" else content
    if kind == "llama":  # byte-fallback tokens, in the vocabulary or added: one byte each
        for i, tok in enumerate(tokens):
            if len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
                attrs[i] = int(Attr.BYTE)

    def special(name: str) -> int | None:
        t = _token_text(config.get(f"{name}_token"))
        if t is not None and t in table:
            return table[t]
        ids = _ids(model_config.get(f"{name}_token_id")) or _ids(gen_config.get(f"{name}_token_id"))
        return ids[0] if ids and 0 <= ids[0] < n_vocab else None

    ids = {
        "bos": special("bos"),
        "eos": special("eos"),
        "unk": table.get(unk) if isinstance(unk, str) else None,
        "eot": None,
        "eom": None,
        "pad": special("pad"),
    }
    eog, ids = apply_name_rules(tokens, attrs, ids, "")
    extra = _ids(gen_config.get("eos_token_id")) + ([ids["eos"]] if ids["eos"] is not None else [])
    eog |= {i for i in extra if 0 <= i < n_vocab}
    for i in eog:
        attrs[i] |= int(Attr.CONTROL)
    add_bos, add_eos = _added_specials(hf, config, ids)
    vocab = Vocab(
        model=kind,
        pre="hf",
        tokens=tokens,
        scores=None,
        attrs=attrs,
        merges=None,
        bos_id=ids["bos"],
        eos_id=ids["eos"],
        eot_id=ids["eot"],
        eom_id=ids["eom"],
        unk_id=ids["unk"],
        pad_id=ids["pad"],
        eog_ids=frozenset(eog),
        add_bos=add_bos,
        add_eos=add_eos,
        add_space_prefix=kind == "llama" and _space_prefix(data),
        chat_template=_chat_template(folder, config),
    )
    return vocab, HFEncoder(text)


def _added_specials(hf: HFTokenizer, config: dict, ids: dict) -> tuple[bool, bool]:
    """add_bos/add_eos: tokenizer_config.json's flags, else what the post-processor adds."""
    plain = hf.encode("a", add_special_tokens=False).ids
    full = hf.encode("a", add_special_tokens=True).ids
    start = full.index(plain[0]) if plain and plain[0] in full else 0
    adds_bos = start > 0 and full[0] == ids["bos"]
    adds_eos = len(full) > start + len(plain) and full[-1] == ids["eos"]
    bos, eos = config.get("add_bos_token"), config.get("add_eos_token")
    return (
        bos if isinstance(bos, bool) else adds_bos,
        eos if isinstance(eos, bool) else adds_eos,
    )
