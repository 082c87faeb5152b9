"""engine/fim.py: finding a model's FIM tokens and the PSM prompt ids, checked id for id.

The end-to-end FIM tests (/infill, completions `suffix`) run on the multi-model server in
test_router.py, which serves a SmolLM2 copy given FIM token ids in its metadata.
"""

import pytest

from localllm.engine.fim import FimChunk, FimTokens, fim_prompt, fim_tokens_for, find_fim_tokens
from localllm.engine.gguf import open_gguf
from localllm.engine.tokenizer import Tokenizer

K = "tokenizer.ggml."


def _vocab(*texts: str) -> dict[str, int]:
    return {t: 100 + i for i, t in enumerate(texts)}


def test_metadata_ids_win_over_token_texts():
    meta = {K + "fim_pre_token_id": 7, K + "fim_suf_token_id": 8, K + "fim_mid_token_id": 9,
            K + "fim_sep_token_id": 11}  # fmt: skip
    vocab = _vocab("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<fim_pad>")
    assert find_fim_tokens(meta, vocab) == FimTokens(7, 8, 9, pad=None, rep=None, sep=11)
    old = {K + "prefix_token_id": 1, K + "suffix_token_id": 2, K + "middle_token_id": 3}
    assert find_fim_tokens(old, {}) == FimTokens(1, 2, 3)
    unset = {K + "fim_pre_token_id": -1, K + "fim_suf_token_id": 8, K + "fim_mid_token_id": 9}
    assert find_fim_tokens(unset, {}) is None  # -1 is "not set" in llama.cpp's converter


@pytest.mark.parametrize(
    ("texts", "expected"),
    [
        (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>",
          "<|file_sep|>"), FimTokens(100, 101, 102, 103, 104, 105)),
        (("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<fim_pad>", "<repo_name>",
          "<file_sep>"), FimTokens(100, 101, 102, 103, 104, 105)),
        (("▁<PRE>", "▁<SUF>", "▁<MID>"), FimTokens(100, 101, 102)),
        (("<PRE>", "<SUF>", "<MID>"), FimTokens(100, 101, 102)),
        (("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"), FimTokens(100, 101, 102)),
        (("<fim_prefix>", "<fim_suffix>"), None),  # no middle token: not a FIM model
        (("<|im_start|>", "<repo_name>", "<file_sep>"), None),  # SmolLM2's specials
    ],
)  # fmt: skip
def test_well_known_token_texts(texts, expected):
    assert find_fim_tokens({}, _vocab(*texts)) == expected


def test_metadata_extras_complete_a_text_family():
    vocab = _vocab("<fim_prefix>", "<fim_suffix>", "<fim_middle>")
    assert find_fim_tokens({K + "fim_sep_token_id": 5}, vocab) == FimTokens(100, 101, 102, sep=5)


@pytest.fixture(scope="module")
def smol(smollm2_path):
    with open_gguf(smollm2_path) as g:
        meta = dict(g.metadata)
    return meta, Tokenizer.from_gguf_metadata(meta)


def test_smollm2_has_no_fim_tokens_unless_its_metadata_names_them(smol):
    meta, tok = smol
    assert fim_tokens_for(meta, tok) is None
    named = {**meta, K + "fim_pre_token_id": 3, K + "fim_suf_token_id": 4,
             K + "fim_mid_token_id": 5}  # fmt: skip
    assert fim_tokens_for(named, tok) == FimTokens(3, 4, 5)
    outside = {**named, K + "fim_mid_token_id": tok.vocab_size}
    assert fim_tokens_for(outside, tok) is None


def test_psm_prompt_ids(smol):
    _, tok = smol
    fim = FimTokens(3, 4, 5)

    def enc(s: str) -> list[int]:
        return tok.encode(s, add_special=False, parse_special=False)

    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
    ids = fim_prompt(tok, fim, prefix, suffix, prompt="a +")
    assert ids == [3, *enc(prefix), *enc("a +"), 4, *enc(suffix), 5]
    # Special-token text in user code stays text (SmolLM2 adds no BOS).
    sneaky = fim_prompt(tok, fim, "<|im_start|>", "")
    assert sneaky == [3, *enc("<|im_start|>"), 4, 5] and 1 not in sneaky


def test_extra_files_go_first_with_repo_and_file_separators(smol):
    _, tok = smol

    def enc(s: str) -> list[int]:
        return tok.encode(s, add_special=False, parse_special=False)

    extra = [FimChunk("util.py", "X = 1\n"), FimChunk("b.py", "Y = 2\n")]
    ids = fim_prompt(tok, FimTokens(3, 4, 5, rep=6, sep=7), "p", "s", extra=extra)
    head = [6, *enc("myproject\n"), 7, *enc("util.py\n"), *enc("X = 1\n"),
            7, *enc("b.py\n"), *enc("Y = 2\n"), 7, *enc("filename\n")]  # fmt: skip
    assert ids == [*head, 3, *enc("p"), 4, *enc("s"), 5]
    plain = fim_prompt(tok, FimTokens(3, 4, 5), "p", "s", extra=extra[:1])
    snippet = enc("\n\n--- snippet ---\n\n")
    assert plain == [*snippet, *enc("X = 1\n"), 3, *enc("p"), 4, *enc("s"), 5]


def test_long_inputs_keep_the_text_nearest_the_cursor(smol):
    _, tok = smol

    def enc(s: str) -> list[int]:
        return tok.encode(s, add_special=False, parse_special=False)

    prefix = "".join(f"line{i} = {i}\n" for i in range(200))
    suffix = "".join(f"after{i}()\n" for i in range(200))
    pre, suf = enc(prefix), enc(suffix)
    ids = fim_prompt(tok, FimTokens(3, 4, 5), prefix, suffix, max_tokens=103)
    room = 100  # 103 minus the three FIM tokens; 3:1 between prefix and suffix
    assert ids == [3, *pre[-(room - room // 4) :], 4, *suf[: room // 4], 5]
    short = fim_prompt(tok, FimTokens(3, 4, 5), prefix, "x", max_tokens=103)
    assert short == [3, *pre[-(room - 1) :], 4, *enc("x"), 5]  # a short suffix leaves room
    with pytest.raises(ValueError, match="infill context"):
        fim_prompt(tok, FimTokens(3, 4, 5), "a", "b", max_tokens=4)
