"""Name-based special-token rules, as llama.cpp applies them when it loads a vocabulary.

GGUF files mark control tokens with a type, but many conversions get it wrong or leave out the
end-of-turn ids. llama.cpp therefore recognises well-known token texts (`<|im_end|>`,
`<end_of_turn>`, `<|eot_id|>`, FIM markers, ...), forces them to be control tokens, and derives the
set of end-of-generation (EOG) tokens from them. We repeat those rules so that the same text
tokenizes the same way and generation stops on the same tokens as in llama.cpp.
"""

from __future__ import annotations

import numpy as np

from localllm.engine.tokenizer.attrs import Attr

CONTROL = int(Attr.CONTROL)
UNUSED = int(Attr.UNUSED)
NORMAL = int(Attr.NORMAL)
USER_DEFINED = int(Attr.USER_DEFINED)
RSTRIP = int(Attr.RSTRIP)
SPECIAL_ATTRS = int(Attr.CONTROL | Attr.USER_DEFINED | Attr.UNKNOWN)

# Texts that name an end-of-turn token when the file gives no tokenizer.ggml.eot_token_id.
EOT_NAMES = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
)
EOM_NAMES = ("<|eom_id|>",)
# Fill-in-the-middle markers: recognised (and made control tokens) like the EOT names.
FIM_NAMES = {
    "pre": (
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<｜fim▁begin｜>",
        "<PRE>",
        "▁<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
    ),
    "suf": (
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<｜fim▁hole｜>",
        "<SUF>",
        "▁<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
    ),
    "mid": (
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<｜fim▁end｜>",
        "<MID>",
        "▁<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
# Texts that always end generation.
EOG_NAMES = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
)
# gpt-oss: always rendered, so they are user-defined rather than control tokens.
ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


def _first_id(index: dict[str, int], names: tuple[str, ...]) -> int | None:
    found = [index[n] for n in names if n in index]
    return min(found) if found else None


ALL_NAMES = frozenset(
    {*EOT_NAMES, *EOM_NAMES, *EOG_NAMES, *ALWAYS_RENDERED, "</s>", "<unk>", "<s>"}.union(
        *FIM_NAMES.values()
    )
)


def _name_index(tokens: list[str]) -> dict[str, int]:
    """Ids of the known names present, the last duplicate winning as in llama.cpp's map.

    A set intersection runs in C; building a full text -> id map would cost ~10x more.
    """
    found = ALL_NAMES.intersection(tokens)
    if not found:
        return {}
    reverse = tokens[::-1]
    return {name: len(tokens) - 1 - reverse.index(name) for name in found}


def apply_name_rules(
    tokens: list[str],
    attrs: np.ndarray,
    ids: dict[str, int | None],
    model_name: str,
) -> tuple[set[int], dict[str, int | None]]:
    """Patch `attrs` in place by token name and return (EOG ids, special ids with EOT/EOM filled).


    llama.cpp scans an unordered map and takes the first match; we take the lowest id, which is the
    same whenever a vocabulary has only one of the candidate texts (the usual case).
    """
    ids = dict(ids)
    index = _name_index(tokens)

    def force_control(i: int) -> None:
        attrs[i] |= CONTROL

    if ids["eot"] is None and (i := _first_id(index, EOT_NAMES)) is not None:
        ids["eot"] = i
        force_control(i)
    if ids["eom"] is None and (i := _first_id(index, EOM_NAMES)) is not None:
        ids["eom"] = i
        force_control(i)
    fim = {}
    for key, group in FIM_NAMES.items():
        if (i := _first_id(index, group)) is not None:
            fim[key] = i
            force_control(i)

    # Control tokens named "...unused..." are placeholders.
    control = np.flatnonzero(attrs & CONTROL)
    for i in control:
        if "unused" in tokens[i]:
            attrs[i] |= UNUSED

    eog = {fim[k] for k in ("pad", "rep", "sep") if k in fim}
    for name in EOG_NAMES:
        if name in index:
            eog.add(index[name])
            force_control(index[name])
    for name in ALWAYS_RENDERED:
        if name in index:
            attrs[index[name]] = USER_DEFINED
    eog.update(i for i in (ids["eos"], ids["eot"], ids["eom"]) if i is not None)

    texts = {tokens[i]: i for i in eog}
    calls = "<|call|>" in texts or "<|calls|>" in texts
    if "<|end|>" in texts and calls and ("<|return|>" in texts or "<|flush|>" in texts):
        # gpt-oss / solar-open: <|end|> closes a message, not the generation.
        eog.discard(texts["<|end|>"])
        attrs[texts["<|end|>"]] = USER_DEFINED
    if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
        eog.discard(texts["</s>"])
        attrs[texts["</s>"]] = NORMAL

    lowered = model_name.lower()
    if "phi-3" in lowered or "phi3" in lowered:
        # Phi-3 chat templates put a newline after each special token that the model never saw.
        attrs[np.flatnonzero(attrs & SPECIAL_ATTRS)] |= RSTRIP
        if "</s>" in index:
            attrs[index["</s>"]] |= RSTRIP
        for name in ("<unk>", "<s>", "<|endoftext|>"):
            if name in index:
                attrs[index[name]] &= ~RSTRIP
    return eog, ids
