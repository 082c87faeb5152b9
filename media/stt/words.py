"""Words from BPE tokens, as openai-whisper forms them for word timestamps.

Tokens are first grouped so that each group decodes to whole characters (a multi-byte character
may span tokens); then, for languages written with spaces, groups that neither start with a space
nor are punctuation join the word before them. Leading and trailing punctuation is merged into
its neighbouring word afterwards, with the same character sets as openai-whisper.
"""

import string
from typing import Protocol

from localllm.media.stt.tokenizer import WhisperTokenizer

PREPEND_PUNCTUATIONS = "\"'“¿([{-"
APPEND_PUNCTUATIONS = "\"'.。,，!！?？:：”)]}、"
# scripts written without spaces: every character group is a word
NO_SPACE_LANGUAGES = frozenset({"zh", "ja", "th", "lo", "my", "yue"})


class WordLike(Protocol):
    word: str
    tokens: list[int]


def split_on_unicode(tok: WhisperTokenizer, tokens: list[int]) -> tuple[list[str], list[list[int]]]:
    """Groups of tokens that each decode to complete characters."""
    full = tok.decode(tokens)
    words: list[str] = []
    groups: list[list[int]] = []
    current: list[int] = []
    offset = 0
    for t in tokens:
        current.append(t)
        text = tok.decode(current)
        bad = text.find("\ufffd")
        # a replacement character is complete only when the full text has one there too
        if bad < 0 or (offset + bad < len(full) and full[offset + bad] == "\ufffd"):
            words.append(text)
            groups.append(current)
            current = []
            offset += len(text)
    return words, groups


def split_to_word_tokens(
    tok: WhisperTokenizer, tokens: list[int], language: str
) -> tuple[list[str], list[list[int]]]:
    """Words of `tokens` (text tokens only) and the tokens each is made of."""
    pieces, groups = split_on_unicode(tok, tokens)
    if language in NO_SPACE_LANGUAGES:
        return pieces, groups
    words: list[str] = []
    word_tokens: list[list[int]] = []
    for piece, group in zip(pieces, groups, strict=True):
        # "".strip() is in any string: an empty or blank piece starts a word, as in whisper
        if piece.startswith(" ") or piece.strip() in string.punctuation or not words:
            words.append(piece)
            word_tokens.append(list(group))
        else:
            words[-1] += piece
            word_tokens[-1].extend(group)
    return words, word_tokens


def merge_punctuations(
    alignment: list[WordLike],
    prepended: str = PREPEND_PUNCTUATIONS,
    appended: str = APPEND_PUNCTUATIONS,
) -> None:
    """Attach opening punctuation to the next word and closing punctuation to the previous
    one, in place; a merged-away entry keeps its slot with an empty word and no tokens."""
    i, j = len(alignment) - 2, len(alignment) - 1
    while i >= 0:
        prev, nxt = alignment[i], alignment[j]
        if prev.word.startswith(" ") and prev.word.strip() in prepended:
            nxt.word, nxt.tokens = prev.word + nxt.word, prev.tokens + nxt.tokens
            prev.word, prev.tokens = "", []
        else:
            j = i
        i -= 1
    i, j = 0, 1
    while j < len(alignment):
        prev, nxt = alignment[i], alignment[j]
        if not prev.word.endswith(" ") and nxt.word in appended:
            prev.word, prev.tokens = prev.word + nxt.word, prev.tokens + nxt.tokens
            nxt.word, nxt.tokens = "", []
        else:
            i = j
        j += 1
