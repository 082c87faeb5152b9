"""A folder's tokenizer (tokenizer.json + tokenizer_config.json + generation_config.json) against
transformers' AutoTokenizer on the same files: ids, text back, special tokens, chat prompts."""

import pytest

from localllm.engine.llm_engine import LLMEngine
from tests.engine.hf_fixtures import save_tiny

TEXTS = [
    "Hello, world! The quick brown fox",
    "  leading spaces and\ttabs\n\nnew lines  ",
    "Über café naïve — 東京 🦙 12345",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text with <|im_end|> inside",
    "",
]


@pytest.fixture(scope="module", params=["qwen3", "gemma3"], ids=["byte-level", "sentencepiece"])
def pair(request, tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    d = save_tiny(request.param, tmp_path_factory.mktemp("tok") / request.param)
    engine = LLMEngine(str(d))
    yield engine, transformers.AutoTokenizer.from_pretrained(d)
    engine.close()


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(pair, text):
    engine, ref = pair
    tok = engine.tokenizer
    want = ref(text)["input_ids"]
    assert tok.encode(text, add_special=True, parse_special=True) == want
    plain = ref(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert tok.encode(text, add_special=False, parse_special=False) == plain
    assert tok.decode(want) == ref.decode(want)
    assert tok.decode(want, skip_special=True) == ref.decode(want, skip_special_tokens=True)


def test_specials_and_stops(pair):
    engine, ref = pair
    tok = engine.tokenizer
    assert tok.bos_id == ref.bos_token_id and tok.eos_id == ref.eos_token_id
    # generation_config.json's eos_token_id list stops generation, as transformers' generate
    assert {0, 2} <= tok.eog_ids
    assert tok.is_special(ref.convert_tokens_to_ids("<|im_start|>"))


def test_chat_prompt_matches_apply_chat_template(pair):
    engine, ref = pair
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    want = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if not isinstance(want, list) else want
    assert engine.chat_prompt(messages) == list(want)
