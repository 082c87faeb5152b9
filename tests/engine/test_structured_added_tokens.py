"""Forced text through the llguidance bridge never names a token llguidance holds special.

Qwen's `<tool_call>` / `</tool_call>` are added tokens that are not special to the tokenizer
(it matches them in plain text), but user-defined tokens written like `<name>` are special to
llguidance (llama.cpp's rule, `special_ids`). When a grammar forces the text `</tool_call>` (the
Hermes call grammar's end), the bridge must spell it in ordinary tokens: the added token's id
made llguidance refuse the step (a 500 on every forced Qwen tool call)."""

from localllm.engine.gguf import open_gguf
from localllm.engine.sampling.structured_vocab import TokenSource, special_ids
from localllm.engine.tokenizer import Tokenizer
from tests.engine.family_goldens import path


def test_forced_text_avoids_special_added_tokens():
    with open_gguf(path("qwen3next")) as g:
        tok = Tokenizer.from_gguf_metadata(g.metadata)
    pieces = [tok.piece(i) for i in range(tok.vocab_size)]
    specials = special_ids(tok)
    close = tok.encode("</tool_call>", add_special=False, parse_special=False)
    assert len(close) == 1 and close[0] in specials  # the tokenizer itself takes the added token
    source = TokenSource(tok, pieces, specials)
    for text in ("</tool_call>", "}\n</tool_call>", "a <tool_call> b"):
        ids = source(text)
        assert b"".join(pieces[i] for i in ids) == text.encode(), text
        assert not set(ids) & set(specials), (text, ids)
    assert source("Paris") == tok.encode("Paris", add_special=False)  # plain text: unchanged
