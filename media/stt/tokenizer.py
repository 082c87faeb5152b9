"""Whisper's tokenizer: a `tokenizers` BPE plus the special-token ids decoding needs.

The ids are looked up by name in the tokenizer (multilingual and English-only vocabularies put
them at different places). Non-speech suppression lists come from the checkpoint's config when
it has them, else they are derived as openai-whisper does.
"""

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

# openai-whisper's list of symbols that are not speech (tokenizer.non_speech_tokens).
_SYMBOLS = list('"#()*+/:;<=>@[\\]^_`{|}~「」『』')
_SYMBOLS += [
    "<<",
    ">>",
    "<<<",
    ">>>",
    "--",
    "---",
    "-(",
    "-[",
    "('",
    '("',
    "((",
    "))",
    "(((",
    ")))",
    "[[",
    "]]",
    "{{",
    "}}",
    "♪♪",
    "♪♪♪",
]
_MISC = set("♩♪♫♬♭♮♯")


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of Whisper's control tokens; `timestamp_begin` is <|0.00|>."""

    eot: int
    sot: int
    translate: int
    transcribe: int
    sot_lm: int
    sot_prev: int
    no_speech: int
    no_timestamps: int
    timestamp_begin: int
    languages: tuple[str, ...]  # codes in id order, starting at sot + 1

    def language_id(self, code: str) -> int:
        try:
            return self.sot + 1 + self.languages.index(code)
        except ValueError:
            raise ValueError(f"unknown language {code!r} for this model") from None


class WhisperTokenizer:
    """Encode prompts, decode text tokens, and know the special ids."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        ids = {name: tokenizer.token_to_id(name) for name in _NAMES}
        missing = [n for n, i in ids.items() if i is None]
        if missing:
            raise ValueError(f"not a Whisper tokenizer: no {', '.join(missing)}")
        langs = []
        i = ids["<|startoftranscript|>"] + 1
        while i < ids["<|translate|>"]:
            langs.append((tokenizer.id_to_token(i) or "<|?|>")[2:-2])
            i += 1
        nospeech = ids.get("<|nospeech|>") or tokenizer.token_to_id("<|nocaptions|>")
        self.special = SpecialTokens(
            eot=ids["<|endoftext|>"],
            sot=ids["<|startoftranscript|>"],
            translate=ids["<|translate|>"],
            transcribe=ids["<|transcribe|>"],
            sot_lm=ids["<|startoflm|>"],
            sot_prev=ids["<|startofprev|>"],
            no_speech=nospeech if nospeech is not None else -1,
            no_timestamps=ids["<|notimestamps|>"],
            timestamp_begin=ids["<|notimestamps|>"] + 1,
            languages=tuple(langs),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "WhisperTokenizer":
        return cls(Tokenizer.from_file(str(path)))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Text of the ordinary tokens in `ids` (control and timestamp tokens are dropped)."""
        return self.tok.decode([i for i in ids if i < self.special.eot], skip_special_tokens=False)

    def non_speech_tokens(self) -> list[int]:
        """Tokens for symbols that are never speech, as openai-whisper derives them."""
        result = {self.encode(" -")[0], self.encode(" '")[0]}
        for symbol in _SYMBOLS + sorted(_MISC):
            for ids in (self.encode(symbol), self.encode(" " + symbol)):
                if len(ids) == 1 or (symbol in _MISC and ids):
                    result.add(ids[0])
        return sorted(result)


_NAMES = (
    "<|endoftext|>",
    "<|startoftranscript|>",
    "<|translate|>",
    "<|transcribe|>",
    "<|startoflm|>",
    "<|startofprev|>",
    "<|notimestamps|>",
)
