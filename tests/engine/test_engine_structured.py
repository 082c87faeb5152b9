"""Structured output end to end on the real SmolLM2: every one of the 20 schemas yields JSON that
validates, regex and choice are honoured, and grammar requests batch with free ones."""

import json
import re

import pytest

from localllm.engine import LLM, SamplingParams, StructuredOutputParams
from tests.engine.structured_schemas import SCHEMAS, check

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(smollm2_path):
    with LLM(str(smollm2_path), max_num_seqs=20) as llm:
        yield llm


def _ask(schema) -> list[dict]:
    text = "Reply with a JSON value for this schema:\n" + json.dumps(schema)
    return [{"role": "user", "content": text}]


def test_twenty_schemas_always_valid(llm):
    params = [
        SamplingParams(
            temperature=0.7,
            seed=i,
            max_tokens=256,
            structured=StructuredOutputParams(json=schema),
        )
        for i, schema in enumerate(SCHEMAS)
    ]
    assert len(SCHEMAS) == 20
    outs = llm.chat([_ask(s) for s in SCHEMAS], params)
    cut = []
    for i, (schema, out) in enumerate(zip(SCHEMAS, outs, strict=True)):
        comp = out.outputs[0]
        if comp.finish_reason == "length":
            # A recursive schema lets a 135M model nest until max_tokens, and an email's local
            # part is unbounded (at temperature 0.7 it may ramble on: "jimmy-http-2020-12-01_22.
            # 62.30.138/need-to-..."); nothing else may stop short of a complete value.
            dumped = json.dumps(schema)
            assert "$ref" in dumped or '"format": "email"' in dumped, (i, comp.text)
            cut.append(i)
            continue
        assert comp.finish_reason == "stop", (i, comp.finish_reason, comp.text)
        value = json.loads(comp.text)
        assert check(value, schema) == [], (i, comp.text)
    assert len(cut) <= 2, cut  # the recursive one and the email one at most


def test_json_object_regex_and_choice(llm):
    p = [
        SamplingParams(temperature=0, max_tokens=256, structured=StructuredOutputParams(**kw))
        for kw in (
            {"json_object": True},
            {"regex": r"[A-Z][a-z]{2,8} \d{4}-\d{2}-\d{2}"},
            {"choice": ("positive", "negative", "neutral")},
        )
    ]
    prompts = [
        [{"role": "user", "content": "A JSON object with a cat's name and age."}],
        [{"role": "user", "content": "Give a name and a date."}],
        [{"role": "user", "content": "Sentiment of 'I love this!'?"}],
    ]
    obj, rx, ch = (o.outputs[0] for o in llm.chat(prompts, p))
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.text), dict)
    assert re.fullmatch(r"[A-Z][a-z]{2,8} \d{4}-\d{2}-\d{2}", rx.text), rx.text
    assert ch.text in ("positive", "negative", "neutral")


def test_grammar_does_not_leak_into_batch_neighbours(llm):
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = llm.generate(["The capital of France is"], free)[0].outputs[0].text
    constrained = SamplingParams(
        temperature=0, max_tokens=16, structured=StructuredOutputParams(regex="[0-9]+")
    )
    outs = llm.generate(["The capital of France is", "Pick a number:"], [free, constrained])
    assert outs[0].outputs[0].text == alone
    assert re.fullmatch("[0-9]+", outs[1].outputs[0].text)
