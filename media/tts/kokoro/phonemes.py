"""Text to Kokoro phoneme sentences through our espeak-ng path.

Kokoro was trained on misaki's symbols: IPA where espeak and misaki agree, single letters for
diphthongs and affricates (`A`=eɪ, `I`=aɪ, `O`=oʊ, `W`=aʊ, `Y`=ɔɪ, `ʤ`, `ʧ`, ...). espeak is
asked to tie multi-letter phonemes (`a^ɪ`) so these are found without guessing syllable edges;
the rewrite rules below are misaki's espeak rules (facts of the format). A voice's first letter
names its language (`af_heart`: a = American English).
"""

from __future__ import annotations

import re
import unicodedata

from localllm.media.tts.phonemize import Sentence, phonemize

_TIE = "^"
# voice-name prefix -> espeak-ng voice
ESPEAK_VOICES = {
    "a": "en-us",
    "b": "en-gb",
    "e": "es",
    "f": "fr-fr",
    "h": "hi",
    "i": "it",
    "j": "ja",
    "p": "pt-br",
    "z": "cmn",
}
_ENGLISH_RULES = (
    ("ʔˌn\u0329", "ʔn"),
    ("ʔn\u0329", "ʔn"),
    ("a^ɪ", "I"),
    ("a^ʊ", "W"),
    ("d^ʒ", "ʤ"),
    ("e^ɪ", "A"),
    ("t^ʃ", "ʧ"),
    ("ɔ^ɪ", "Y"),
    ("ə^l", "ᵊl"),
    ("ʲo", "jo"),
    ("ʲə", "jə"),
    ("ʲ", ""),
    ("ɚ", "əɹ"),
    ("e", "A"),
    ("r", "ɹ"),
    ("x", "k"),
    ("ç", "k"),
    ("ɐ", "ə"),
    ("ɬ", "l"),
    ("\u0303", ""),
)
_AMERICAN_RULES = (("ɜːɹ", "ɜɹ"), ("ɜː", "ɜɹ"), ("ɪə", "iə"), ("ː", ""))
_OTHER_RULES = (
    ("a^ɪ", "I"),
    ("a^ʊ", "W"),
    ("d^z", "ʣ"),
    ("d^ʒ", "ʤ"),
    ("e^ɪ", "A"),
    ("o^ʊ", "O"),
    ("ə^ʊ", "Q"),
    ("s^s", "S"),
    ("t^s", "ʦ"),
    ("t^ʃ", "ʧ"),
    ("ɔ^ɪ", "Y"),
)


def espeak_voice(voice_name: str) -> str:
    """The espeak voice for a Kokoro voice name (unknown prefixes read as American English)."""
    return ESPEAK_VOICES.get(voice_name[:1], "en-us")


def _apply(text: str, rules: tuple[tuple[str, str], ...]) -> str:
    for old, new in rules:
        text = text.replace(old, new)
    return text


def to_kokoro(ipa: str, language: str) -> str:
    """espeak IPA (NFC, ties as `^`) -> Kokoro's symbols for an espeak voice `language`."""
    if language in ("en-us", "en-gb"):
        british = language == "en-gb"
        # diphthongs that the generic rules would split come first
        first = (("e^ə", "ɛː"), ("ə^ʊ", "Q")) if british else (("o^ʊ", "O"),)
        ps = _apply(_apply(ipa, first), _ENGLISH_RULES)
        ps = re.sub(r"(\S)\u0329", r"ᵊ\1", ps).replace("\u0329", "")
        ps = ps.replace("iə", "ɪə") if british else _apply(ps, _AMERICAN_RULES)
        # older espeak writes o for ɔ; the v1.0 model reads flaps as T and glottal stops as t
        ps = ps.replace("o", "ɔ").replace("ɾ", "T").replace("ʔ", "t")
    else:
        ps = _apply(ipa, _OTHER_RULES).replace("-", "")
    return ps.replace(_TIE, "")


def _chunks(ps: str, limit: int) -> list[str]:
    """Cut a phoneme string longer than `limit` at spaces (a word is never split)."""
    out: list[str] = []
    while len(ps) > limit:
        cut = ps.rfind(" ", 0, limit + 1)
        cut = cut if cut > 0 else limit
        out.append(ps[:cut].strip())
        ps = ps[cut:].strip()
    out.append(ps)
    return [p for p in out if p]


def kokoro_sentences(text: str, language: str, vocab: dict[str, int], limit: int) -> list[Sentence]:
    """Sentences of Kokoro symbols (only those in `vocab`), each at most `limit` long."""
    out: list[Sentence] = []
    for sentence in phonemize(text, language, tie=_TIE):
        ipa = unicodedata.normalize("NFC", sentence.text)
        ps = "".join(c for c in to_kokoro(ipa, language) if c in vocab).strip()
        ps = re.sub(r" +", " ", ps)
        for chunk in _chunks(ps, limit):
            if any(c.isalpha() for c in chunk):
                out.append(Sentence(tuple(chunk)))
    return out
