"""Token id -> raw bytes, as llama.cpp's `token_to_piece(special=True)` produces them.

- SentencePiece (`llama`) and WordPiece (`bert`) normal tokens: the text with `▁` turned back into
  spaces.
- Byte-level BPE (`gpt2`) normal tokens: each character maps back to one byte through GPT-2's
  byte-to-unicode table; a character outside that table gives llama.cpp's `[UNK_BYTE_0x..]` marker.
  Both conversions run over all tokens at once (numpy over code points): a Python loop per
  character would cost ~0.3 s for a 150k vocabulary.
- Byte tokens `<0xNN>`: the byte NN. Control, user-defined and unknown tokens: their text.
- Any other type (unused, undefined): nothing.
"""

from __future__ import annotations

import numpy as np

from localllm.engine.tokenizer.attrs import Attr
from localllm.engine.tokenizer.vocab import Vocab

_TEXT_ATTRS = Attr.CONTROL | Attr.USER_DEFINED | Attr.UNKNOWN


def utf8(text: str) -> bytes:
    """Token texts from a GGUF may carry invalid UTF-8 as surrogate escapes: give the bytes back."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace")


def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's reversible map from 256 printable characters back to byte values."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


def _utf8_lengths(cps: np.ndarray) -> np.ndarray:
    """Encoded length of each code point (surrogate escapes stand for one raw byte)."""
    n = 1 + (cps >= 0x80) + (cps >= 0x800) + (cps >= 0x10000)
    return np.where((cps >= 0xDC80) & (cps <= 0xDCFF), 1, n)


def _split(buf: bytes, lengths: np.ndarray) -> list[bytes]:
    ends = np.cumsum(lengths).tolist()
    starts = [0, *ends[:-1]]
    return [buf[a:b] for a, b in zip(starts, ends, strict=True)]


def _code_points(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """All code points of `texts` concatenated, and the owning text of each."""
    cps = np.frombuffer("".join(texts).encode("utf-32-le", "surrogatepass"), np.uint32)
    lens = np.fromiter(map(len, texts), np.int64, len(texts))
    return cps, np.repeat(np.arange(len(texts)), lens)


def _spm_bytes(texts: list[str]) -> list[bytes]:
    """`▁` -> space, then UTF-8, for many texts with one encode call."""
    cps, owner = _code_points(texts)
    per_cp = np.where(cps == 0x2581, 1, _utf8_lengths(cps))
    lengths = np.bincount(owner, weights=per_cp, minlength=len(texts)).astype(np.int64)
    joined = "".join(texts).replace("▁", " ")
    try:
        buf = joined.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # lone surrogates outside the escape range: rare, go one by one
        return [utf8(t.replace("▁", " ")) for t in texts]
    return _split(buf, lengths)


def _byte_level_bytes(texts: list[str]) -> list[bytes]:
    """GPT-2 byte-level texts back to bytes through a lookup table over code points."""
    lut = np.full(512, -1, np.int16)
    for ch, b in gpt2_byte_decoder().items():
        lut[ord(ch)] = b
    cps, owner = _code_points(texts)
    values = np.where(cps < 512, lut[np.minimum(cps, 511)], -1)
    lengths = np.bincount(owner, minlength=len(texts))
    out = _split(values.astype(np.uint8).tobytes(), lengths)
    for i in np.unique(owner[values < 0]).tolist():
        out[i] = _unk_byte_fallback(texts[i])
    return out


def _unk_byte_fallback(text: str) -> bytes:
    # llama.cpp's marker for a character the byte-level table has no byte for (it does repeat the
    # whole token text inside the marker).
    decoder = gpt2_byte_decoder()
    out = bytearray()
    for ch in text:
        b = decoder.get(ch)
        if b is not None:
            out.append(b)
        else:
            out += b"[UNK_BYTE_0x" + utf8(ch).hex().encode() + utf8(text) + b"]"
    return bytes(out)


def _byte_token_value(text: str) -> bytes:
    try:
        return bytes([int(text[3:5], 16)])
    except ValueError:
        return b""


def build_pieces(vocab: Vocab) -> list[bytes]:
    """The bytes of every token, indexed by id."""
    attrs = vocab.attrs
    tokens = vocab.tokens
    pieces: list[bytes] = [b""] * len(tokens)
    is_text = (attrs & int(_TEXT_ATTRS)) != 0
    is_normal = ~is_text & ((attrs & int(Attr.NORMAL)) != 0)
    is_byte = ~is_text & ~is_normal & ((attrs & int(Attr.BYTE)) != 0)
    for i in np.flatnonzero(is_text).tolist():
        pieces[i] = utf8(tokens[i])
    for i in np.flatnonzero(is_byte).tolist():
        pieces[i] = _byte_token_value(tokens[i])
    normal = np.flatnonzero(is_normal).tolist()
    texts = [tokens[i] for i in normal]
    # WordPiece tokens in GGUF mark word starts with ▁ as SentencePiece does.
    spm_like = vocab.model in ("llama", "bert")
    converted = _spm_bytes(texts) if spm_like else _byte_level_bytes(texts)
    for i, piece in zip(normal, converted, strict=True):
        pieces[i] = piece
    return pieces
