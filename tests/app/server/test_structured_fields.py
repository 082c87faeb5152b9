"""Structured output under every peer API's spelling is honoured (before, all but
`response_format` were dropped and the answer came back unconstrained), and what cannot be
honoured is a 400."""

import json
import re

import httpx
import jsonschema
import pytest

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Tell me about the weather today."}]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "rain": {"type": "boolean"}},
    "required": ["city", "rain"],
    "additionalProperties": False,
}
GBNF = 'root ::= "cat" | "dog" | "bird"'


def _check_schema(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


def _check_digits(text: str) -> None:
    assert re.fullmatch(r"[0-9]{3}-[0-9]{2}", text), text


def _check_choice(text: str) -> None:
    assert text in ("yes", "no", "maybe"), text


def _check_pet(text: str) -> None:
    assert text in ("cat", "dog", "bird"), text


def _check_object(text: str) -> None:
    # Any object may run past max_tokens: then it must still be an object's beginning.
    try:
        assert isinstance(json.loads(text), dict), text
    except json.JSONDecodeError:
        assert text.startswith("{") and len(text) > 60, text


# (request fields, what the answer must be); every spelling peers use.
SPELLINGS = {
    "structured_outputs.json": ({"structured_outputs": {"json": SCHEMA}}, _check_schema),
    "structured_outputs.regex": ({"structured_outputs": {"regex": "[0-9]{3}-[0-9]{2}"}},
                                 _check_digits),
    "structured_outputs.choice": ({"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
                                  _check_choice),
    "structured_outputs.grammar": ({"structured_outputs": {"grammar": GBNF}}, _check_pet),
    "structured_outputs.json_object": ({"structured_outputs": {"json_object": True}},
                                       _check_object),
    "guided_json": ({"guided_json": SCHEMA}, _check_schema),
    "guided_regex": ({"guided_regex": "[0-9]{3}-[0-9]{2}"}, _check_digits),
    "guided_choice": ({"guided_choice": ["yes", "no", "maybe"]}, _check_choice),
    "guided_grammar": ({"guided_grammar": GBNF}, _check_pet),
    "grammar (llama-server)": ({"grammar": GBNF}, _check_pet),
    "json_schema (llama-server)": ({"json_schema": SCHEMA}, _check_schema),
    "response_format json_object + schema (llama-server)": (
        {"response_format": {"type": "json_object", "schema": SCHEMA}}, _check_schema),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_every_spelling_constrains_chat_and_completions(roomy_server, name):
    fields, check = SPELLINGS[name]
    base = {"max_tokens": 48, "temperature": 0, **fields}
    r = httpx.post(roomy_server.base + "/v1/chat/completions", json={"messages": ASK, **base},
                   timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    check(r.json()["choices"][0]["message"]["content"])
    r = httpx.post(roomy_server.base + "/v1/completions",
                   json={"prompt": "The weather today:", **base}, timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    check(r.json()["choices"][0]["text"])


@pytest.mark.parametrize(
    "fields",
    [
        {"guided_regex": "[0-9]+", "response_format": {"type": "json_object"}},
        {"grammar": GBNF, "structured_outputs": {"choice": ["a"]}},
        {"structured_outputs": {"regex": "a", "choice": ["a"]}},
        {"structured_outputs": {"json": SCHEMA, "surprise": 1}},
        {"structured_outputs": {"structural_tag": {"type": "tag"}}},
        {"structured_outputs": {}},
        {"guided_whitespace_pattern": " "},
    ],
)
def test_two_constraints_or_an_unsupported_option_is_a_400(roomy_server, fields):
    body = {"messages": ASK, "max_tokens": 4, **fields}
    r = httpx.post(roomy_server.base + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
