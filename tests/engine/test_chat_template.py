"""Chat templates: Hugging Face conventions, the real SmolLM2 template, and hostile templates that
must fail fast with one ChatTemplateError."""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime

import pytest

from localllm.engine.gguf import open_gguf
from localllm.engine.tokenizer import CHATML_TEMPLATE, ChatTemplate, ChatTemplateError, Tokenizer

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
]


@pytest.fixture(scope="module")
def smollm2(smollm2_path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(open_gguf(smollm2_path).metadata)


def test_smollm2_real_template(smollm2):
    template = ChatTemplate.for_tokenizer(smollm2)
    assert template.source == smollm2.chat_template
    out = template.render([{"role": "user", "content": "Hi"}])
    assert out == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    out = template.render(CHAT, add_generation_prompt=False)
    assert out == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
    )
    ids = smollm2.encode(out)
    assert ids.count(1) == 4 and ids.count(2) == 4  # <|im_start|>, <|im_end|> as single tokens


def test_chatml_fallback_only_through_for_tokenizer(gemma3_path, caplog):
    gemma = Tokenizer.from_gguf_metadata(open_gguf(gemma3_path).metadata)
    assert gemma.chat_template is None  # this GGUF ships none
    template = ChatTemplate.for_tokenizer(gemma)
    assert "using ChatML" in caplog.text
    assert template.source == CHATML_TEMPLATE
    assert template.bos_token == "<bos>" and template.eos_token == "<eos>"
    assert template.render([{"role": "user", "content": "x"}]) == (
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    )


def test_hf_conventions():
    source = (
        "{{ bos_token }}{% set ns = namespace(n=0) %}"
        "{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% if m.role == 'system' %}{% continue %}{% endif %}"
        "[{{ m['role'] }}:{{ m.content|trim }}]{% endfor %}"
        "{% if tools %}TOOLS{{ tools|tojson(indent=2) }}{% endif %}"
        "{% if documents %}{{ documents|length }} docs{% endif %}"
        "n={{ ns.n }} year={{ strftime_now('%Y') }} think={{ enable_thinking }}"
        "{% generation %}G{% endgeneration %}"
        "{% if add_generation_prompt %}{{ eos_token }}{% endif %}"
    )
    tools = [{"name": "f", "description": "ünï", "parameters": {"type": "object"}}]
    out = ChatTemplate(source, "<s>", "</s>").render(
        CHAT, tools=tools, documents=[{"text": "d"}], enable_thinking=False
    )
    expected_tools = json.dumps(tools, ensure_ascii=False, indent=2)
    assert out == (
        f"<s>[user:Hi][assistant:Hello!][user:2+2?]TOOLS{expected_tools}1 docs"
        f"n=4 year={datetime.now().year} think=FalseG</s>"
    )


def test_raise_exception_message_reaches_the_caller():
    source = (
        "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
        "{{ raise_exception('Conversation roles must be user/assistant') }}{% endif %}{% endfor %}"
    )
    template = ChatTemplate(source)
    assert template.render([{"role": "user", "content": "x"}]) == ""
    with pytest.raises(ChatTemplateError, match="roles must be user/assistant"):
        template.render(CHAT)


def test_bad_messages_and_bad_source():
    template = ChatTemplate(CHATML_TEMPLATE)
    with pytest.raises(ChatTemplateError, match="list of mappings"):
        template.render("hello")
    with pytest.raises(ChatTemplateError, match="mapping"):
        template.render(["hello"])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}")
    with pytest.raises(ChatTemplateError):
        ChatTemplate("x" * (2 << 20))


HOSTILE = {
    "attribute escape": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "dunder attribute": "{{ ''.__class__ }}",
    "globals via cycler": "{{ cycler.__init__.__globals__ }}",
    "globals via self": "{{ self.__init__.__globals__ }}",
    "item escape": "{{ ''['__class__'] }}",
    "huge range": "{% for i in range(10**9) %}x{% endfor %}",
    "nested empty loops": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    ),
    "loop over messages squared": (
        "{% for a in range(10**7) %}{% for m in messages %}{% endfor %}{% endfor %}"
    ),
    "string doubling with ~": (
        "{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}"
    ),
    "string doubling with +": (
        "{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
        "{% endfor %}"
    ),
    "block doubling": (
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s %}{{ ns.s }}{{ ns.s }}"
        "{% endset %}{% endfor %}"
    ),
    "repetition": "{{ 'a' * 10**10 }}",
    "power": "{{ 2 ** (10**10) }}",
    "center": "{{ 'x'|center(10**9) }}",
    "str method": "{{ 'x'.ljust(10**9) }}",
    "indent": "{{ ('a\\n' * 500000)|indent(1000) }}",
    "replace": "{{ ('a' * 100000)|replace('a', 'b' * 100000) }}",
    "join of a repeated big string": "{{ ([('a' * 1000000)] * 1000)|join }}",
    "printing a huge list": "{{ [('a' * 1000000)] * 1000 }}",
    "format width": "{{ '%999999999d' % 1 }}",
    "str.format width": "{{ '{:999999999}'.format(1) }}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "enormous output": "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
    "include": "{% include 'other.jinja' %}",
    "lipsum": "{{ lipsum(n=10**6) }}",
    "tojson indent": "{{ messages|tojson(indent=100000) }}",
}


@pytest.mark.parametrize("source", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_templates_fail_fast_and_cleanly(source):
    start = time.monotonic()
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source, "<s>", "</s>", time_limit_s=0.5).render(CHAT)
    assert time.monotonic() - start < 10  # the limit is 0.5 s; generous for slow CI machines


def test_output_cap_scales_with_the_input():
    big = "x" * 5_000_000
    out = ChatTemplate(CHATML_TEMPLATE, max_output_chars=1000).render(
        [{"role": "user", "content": big}]
    )
    assert big in out


def test_concurrent_renders_keep_their_own_budget():
    template = ChatTemplate(CHATML_TEMPLATE, time_limit_s=5)
    results: list[str] = []

    def work() -> None:
        for _ in range(50):
            results.append(template.render([{"role": "user", "content": "hi"}]))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and len(results) == 200


# -- compile time, template size and filter memory (issue 33, item 7) ---------------------------


def test_large_hostile_template_fails_to_compile_fast():
    """252 K characters of output tags compiled for 2 s here (at the old 1 MiB cap: 15-20 s)
    into 3.2 M characters of Python code."""
    source = "{{ m }}" * 36_000
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate(source)
    assert time.monotonic() - start < 5  # the compile limit is 1 s; generous for slow CI


def test_compile_has_a_deadline():
    """The deadline is checked while lexing, parsing and generating code (deterministic at 0)."""
    source = "{% for m in messages %}{{ m['content'] }}{% endfor %}" * 50
    ChatTemplate(source)  # compiles in milliseconds under the default limit
    with pytest.raises(ChatTemplateError, match="compile time limit"):
        ChatTemplate(source, compile_time_limit_s=0)


def test_templates_over_the_size_limit_are_refused_at_once():
    source = "{{ m }}" * 100_000  # 700 K characters: 15 s to compile under the old 1 MiB cap
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match="limit 262144"):
        ChatTemplate(source)
    assert time.monotonic() - start < 1


def test_template_size_limit():
    from localllm.engine.tokenizer.chat_template import MAX_SOURCE_CHARS

    assert MAX_SOURCE_CHARS == 256 * 1024  # 15x the largest real template we know (gpt-oss)
    ChatTemplate("x" * MAX_SOURCE_CHARS)
    with pytest.raises(ChatTemplateError, match="limit 262144"):
        ChatTemplate("x" * (MAX_SOURCE_CHARS + 1))


STRING_EXPLODERS = [
    "c|title",
    "c|sort|length",
    "c|list|length",
    "c|unique|list|length",
    "c|batch(2)|list|length",
    "c|groupby(0)|list|length",
    "c|join('')",
    "c|wordwrap(10)",
    "c|wordcount",
    "c|urlize",
    "c.split()|length",
]


@pytest.mark.parametrize("expr", STRING_EXPLODERS)
def test_filters_that_explode_a_long_string_are_refused_before_they_allocate(expr):
    """`|title` on 4 MB peaked at 350-600 MB: a filter that makes one Python object per
    character, word or line of a string is refused before it runs when that would take more
    than its memory budget (tracemalloc measures what rendering allocates)."""
    import tracemalloc

    content = "中文 " * 500_000  # 1.5 M characters
    template = ChatTemplate(
        "{% set c = messages[0]['content'] %}{{ " + expr + " }}", time_limit_s=60
    )
    tracemalloc.start()
    try:
        with pytest.raises(ChatTemplateError, match="memory"):
            template.render([{"role": "user", "content": content}])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, f"rendering allocated {peak >> 20} MiB"


def test_long_messages_still_pass_the_filters_real_templates_use():
    """The budget counts what a filter makes: two pieces of a split on `</think>`, one copy for
    trim or tojson, however long the message (2 M characters here)."""
    content = "word " * 400_000 + "</think>answer"
    template = ChatTemplate(
        "{% set c = messages[0]['content'] %}"
        "{{ c.split('</think>')[-1]|trim }} {{ c|tojson|length }} {{ c|trim|length }} "
        "{{ messages|map(attribute='content')|list|length }} {{ c|length }}"
    )
    out = template.render([{"role": "user", "content": content}])
    assert out == f"answer {len(content) + 2} {len(content) - 0} 1 {len(content)}"
