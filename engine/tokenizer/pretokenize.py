"""Pre-tokenizer regexes of byte-level BPE vocabularies, per `tokenizer.ggml.pre`.

A GGUF names its pre-tokenizer (`llama-bpe`, `qwen2`, `smollm`, ...) instead of storing the regex.
The table below gives, for each kind, the regexes llama.cpp applies (src/llama-vocab.cpp): each
regex splits every piece the previous one produced into matches and the text between them. The
patterns are llama.cpp's own adaptations (e.g. `(?:'[sS]|...)` for `(?i:'s|...)`), since llama.cpp
is the engine whose token ids we reproduce; Oniguruma, which `tokenizers` uses, reads them all.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tokenizers import Regex, pre_tokenizers

log = logging.getLogger(__name__)

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_TAIL = r"|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*" + _TAIL
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*" + _TAIL
# "Upper-case run then lower-case run" words, as llama.cpp spells \p{Lu}/\p{Ll} without them.
_UP = r"((?=[\p{L}])([^a-z]))"
_LO = r"((?=[\p{L}])([^A-Z]))"
_CASED = rf"[^\r\n\p{{L}}\p{{N}}]?{_UP}*{_LO}+|[^\r\n\p{{L}}\p{{N}}]?{_UP}+{_LO}*"
_GPT4O_WORD = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UP}*{_LO}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UP}+{_LO}*{_CONTRACTIONS}?"
)
_CASED_MARKS = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    + _CONTRACTIONS
    + r"?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    + _CONTRACTIONS
    + "?"
)
_PUNCT_WORD = (
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
)
_CJK_KANA = r"[一-龥぀-ゟ゠-ヿ]+"
# Written with escapes: these ranges include code points that Unicode normalization would change.
_DEEPSEEK_LETTERS = (
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
    "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
    "\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5"
    "\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
    "\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
    "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
    "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
    "\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"


@dataclass(frozen=True)
class PreTokenizerSpec:
    """The regexes of one pre-tokenizer kind and whether BPE skips merges for whole-token words."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False


_DEFAULT = PreTokenizerSpec((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))

# kind -> spec; the kinds follow llama.cpp's LLAMA_VOCAB_PRE_TYPE_* values.
_KINDS: dict[str, PreTokenizerSpec] = {
    "default": _DEFAULT,
    "gpt2": PreTokenizerSpec((_GPT2,)),
    "llama3": PreTokenizerSpec((_LLAMA3,), ignore_merges=True),
    "dbrx": PreTokenizerSpec((_LLAMA3,)),
    "jais2": PreTokenizerSpec(
        (
            _CONTRACTIONS
            + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
            + "".join(rf"|\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4))
            + r"|\s{1,2}(?!\S)|\s{1}",
        )
    ),
    "deepseek-llm": PreTokenizerSpec(
        (
            r"[\r\n]",
            _DEEPSEEK_LETTERS,
            r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
            r"\s+$",
            r"[一-龥ࠀ-一가-퟿]+",
            r"\p{N}+",
        )
    ),
    "deepseek3": PreTokenizerSpec(
        (
            r"\p{N}{1,3}",
            _CJK_KANA,
            _PUNCT_WORD + r"| ?[\p{P}\p{S}]+[\r\n]*" + _TAIL,
        )
    ),
    "spark2_5": PreTokenizerSpec(
        (
            r"\p{N}{1,3}",
            _CJK_KANA,
            _PUNCT_WORD + r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+",
            r"\p{N}",
        )
    ),
    "youtu": PreTokenizerSpec(
        (
            r"[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+",
            _CASED_MARKS + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*" + _TAIL,
        ),
        ignore_merges=True,
    ),
    "deepseek-coder": PreTokenizerSpec(
        (
            r"[\r\n]",
            r"\s?\p{L}+",
            r"\s?\p{P}+",
            r"[一-龥ࠀ-一가-퟿]+",
            r"\p{N}",
        )
    ),
    "falcon": PreTokenizerSpec((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    "starcoder": PreTokenizerSpec((r"\p{N}", _GPT2)),
    "qwen2": PreTokenizerSpec((_QWEN2,)),
    "qwen35": PreTokenizerSpec(
        (
            _CONTRACTIONS
            + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
            + _TAIL,
        )
    ),
    "bloom": PreTokenizerSpec((_BLOOM,)),
    "chatglm4": PreTokenizerSpec((_LLAMA3,)),
    "glm4": PreTokenizerSpec((_LLAMA3,), ignore_merges=True),
    "viking": PreTokenizerSpec((_BLOOM, r"\p{N}")),
    "tekken": PreTokenizerSpec(
        (_CASED + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*" + _TAIL,), ignore_merges=True
    ),
    "chameleon": PreTokenizerSpec(
        (
            r"<sentinel:[0-9]+>",
            r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
            r"([\t\n]|    |  )",
            r"\p{N}",
            r"[\p{P}!-/:-@\[-`{-~]",
            _GPT2,
        )
    ),
    "gpt4o": PreTokenizerSpec((_GPT4O_WORD + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*" + _TAIL,)),
    "tiny_aya": PreTokenizerSpec(
        (
            r"\d{1,3}(?=(?:\d{3})*\b)",
            _CASED_MARKS + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*" + _TAIL,
        )
    ),
    "bailingmoe": PreTokenizerSpec(
        (
            r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
        )
    ),
    "seed-coder": PreTokenizerSpec(
        (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+" + _TAIL,)
    ),
    "ufakzeka": PreTokenizerSpec(
        (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*" + _TAIL,)
    ),
    "laguna": PreTokenizerSpec((r"[^\n]+|[\n]+", _QWEN2)),
    "exaone-moe": PreTokenizerSpec(
        (
            _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
            r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",
        )
    ),
    "minicpm5": PreTokenizerSpec(
        (
            r"\p{N}{1,3}",
            _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*" + _TAIL,
        ),
        ignore_merges=True,
    ),
}

# GGUF `tokenizer.ggml.pre` names -> kind, where the name differs from the kind.
_ALIASES = {
    **dict.fromkeys(
        (
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        ),
        "llama3",
    ),
    **dict.fromkeys(("smaug-bpe",), "dbrx"),
    "jais-2": "jais2",
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), "deepseek3"),
    **dict.fromkeys(
        ("refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
        "starcoder",
    ),
    **dict.fromkeys(
        (
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "granite-docling",
            "exaone4",
            "jina-v1-en",
            "jina-v2-code",
            "roberta-bpe",
        ),
        "gpt2",
    ),
    **dict.fromkeys(
        ("stablelm2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan", "solar-open", "megrez"),
        "qwen2",
    ),
    **dict.fromkeys(("poro-chat", "gpt3-finnish"), "bloom"),
    "chatglm-bpe": "chatglm4",
    "glm5": "glm4",
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), "gpt4o"),
    "cohere2moe": "tiny_aya",
    **dict.fromkeys(("bailingmoe2", "llada-moe"), "bailingmoe"),
    "grok-2": "qwen2",
}


def pre_tokenizer_spec(pre: str) -> PreTokenizerSpec:
    """The spec for a `tokenizer.ggml.pre` name; unknown names fall back to `default`, loudly."""
    kind = _ALIASES.get(pre, pre)
    spec = _KINDS.get(kind)
    if spec is None:
        log.warning(
            "unknown pre-tokenizer %r: using the default regexes; tokenization may differ from "
            "the model's own tokenizer",
            pre,
        )
        return _DEFAULT
    return spec


def byte_level_pre_tokenizer(spec: PreTokenizerSpec) -> pre_tokenizers.PreTokenizer:
    """The regex splits followed by the GPT-2 byte-to-unicode mapping."""
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.regexes]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return pre_tokenizers.Sequence([*splits, byte_level])
