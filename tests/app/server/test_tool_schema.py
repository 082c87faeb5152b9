"""Forced tool calls stay inside the declared parameters.

LangChain and litellm send parameter schemas without `additionalProperties`; JSON Schema's open
default let a forced call add undeclared keys (SmolLM2 filled a `"description"` until the token
limit). The call grammar now closes objects that list their properties, as llama.cpp's
json-schema-to-grammar does, while an explicit `additionalProperties` is kept as given.
"""

import json

import pytest

from localllm.app.server.chat_prep import _trigger_token
from localllm.app.server.tool_parsers import HERMES
from localllm.app.server.tool_prompt import call_grammar, closed_schema
from localllm.engine.gguf import open_gguf
from localllm.engine.sampling.params import StructuredOutputParams
from localllm.engine.sampling.structured import GrammarCompiler
from localllm.engine.tokenizer import Tokenizer

# What LangChain's `with_structured_output(method="function_calling")` sends for a pydantic model.
PERSON = {
    "type": "function",
    "function": {
        "name": "Person",
        "description": "A person.",
        "parameters": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "address": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]},
            },
            "required": ["name"],
        },
    },
}  # fmt: skip


def test_closed_schema_closes_listed_properties_only_where_unsaid():
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
            "free": {"type": "object", "properties": {}, "additionalProperties": True},
            "items": {"type": "array", "items": {"properties": {"c": {}}}},
            "either": {"anyOf": [{"properties": {"d": {}}}, {"type": "string"}]},
            "both": {"allOf": [{"properties": {"e": {}}}, {"properties": {"f": {}}}]},
            "any": {"type": "object"},
        },
        "$defs": {"X": {"properties": {"g": {}}}},
    }
    out = closed_schema(schema)
    props = out["properties"]
    assert out["additionalProperties"] is False
    assert props["a"]["additionalProperties"] is False
    assert props["free"]["additionalProperties"] is True  # said: kept
    assert props["items"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert props["both"] == schema["properties"]["both"]  # closing allOf parts breaks it
    assert props["any"] == {"type": "object"}  # no properties listed: any object
    assert out["$defs"]["X"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is not changed


def test_closed_schema_refuses_absurd_nesting():
    deep: dict = {"type": "string"}
    for _ in range(100):
        deep = {"type": "object", "properties": {"x": deep}}
    with pytest.raises(ValueError, match="nest deeper"):
        closed_schema(deep)


@pytest.fixture(scope="module")
def smol(smollm2_path):
    tok = Tokenizer.from_gguf_metadata(open_gguf(smollm2_path).metadata)
    pieces = [tok.piece(i) for i in range(tok.vocab_size)]
    return tok, GrammarCompiler(tok, tok.vocab_size), pieces


def _accepts(smol, arguments: dict) -> bool:
    """Whether the forced-call grammar lets the model write this call: at each step the longest
    allowed token that spells the text's next bytes (llguidance forces its own tokenization of
    fixed text, so the tokenizer's split of the whole text is not the way in)."""
    tok, compiler, pieces = smol
    trigger, _ = _trigger_token(tok, HERMES)
    grammar = call_grammar(HERMES, [PERSON], parallel=False, trigger_token=trigger)
    matcher = compiler.compile(StructuredOutputParams(grammar=grammar)).matcher()
    call = json.dumps({"name": "Person", "arguments": arguments}, separators=(",", ":"))
    rest = f"{HERMES.trigger}\n{call}\n{HERMES.end}".encode()  # the grammar's compact JSON
    while rest:
        allowed = matcher.allowed().nonzero().flatten().tolist()
        fits = [t for t in allowed if pieces[t] and rest.startswith(pieces[t])]
        if not fits:
            return False
        best = max(fits, key=lambda t: len(pieces[t]))
        assert matcher.accept(best)
        rest = rest[len(pieces[best]) :]
    return matcher.accepting


def test_a_forced_call_takes_declared_keys_and_refuses_undeclared_ones(smol):
    assert _accepts(smol, {"name": "Ada", "address": {"city": "London"}})
    assert not _accepts(smol, {"name": "Ada", "description": "a mathematician"})
    assert not _accepts(smol, {"name": "Ada", "address": {"city": "London", "zip": "N1"}})
