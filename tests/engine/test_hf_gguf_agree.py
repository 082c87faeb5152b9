"""A Hugging Face folder and llama.cpp's GGUF conversion of it run as one model.

tests/data/hf/ (tests/tools/record_hf_fixtures.py): tiny llama, qwen3 and glm4moe folders made with
transformers, and `convert_hf_to_gguf.py --outtype bf16` of each. Read by the engine, both give
the same `ModelArgs`, the same tensors under the same names, value for value (llama's Q/K rope
permutation included), and the same greedy tokens, which are transformers' own on the folder
(up to a near-tie of its fp32 logits).
"""

from pathlib import Path

import pytest
import torch

from localllm.engine.gguf import open_gguf
from localllm.engine.hf import open_hf
from localllm.engine.layers.linear import dense
from localllm.engine.llm import LLM
from localllm.engine.loader import model_args
from localllm.engine.sampling.params import SamplingParams
from tests.engine.hf_fixtures import available
from tests.engine.test_hf_models import assert_same_or_near_tie, hf_greedy

DATA = Path(__file__).parents[1] / "data" / "hf"
FAMILIES = ("llama", "qwen3", "glm4moe")  # glm4moe: with a NextN layer (never run)
PROMPTS = ["Hello, world! The quick brown", "def main():\n", "the cat sat on"]


@pytest.mark.parametrize("family", FAMILIES)
def test_same_args_and_tensors(family):
    with open_hf(DATA / family) as hf, open_gguf(DATA / f"{family}.gguf") as gg:
        assert model_args(hf) == model_args(gg)
        assert set(hf.tensors) == set(gg.tensors)
        for name in gg.tensors:
            a, b = hf.weight(name), gg.weight(name)
            assert a.shape == b.shape and a.qtype == b.qtype, name
            assert torch.equal(dense(a), dense(b)), name


@pytest.mark.parametrize("family", FAMILIES)
def test_same_greedy_tokens_as_gguf_and_transformers(family):
    transformers = pytest.importorskip("transformers")
    if not available(family):
        pytest.skip(f"transformers {transformers.__version__} lacks the {family} classes")
    transformers.logging.set_verbosity_error()
    ref = transformers.AutoModelForCausalLM.from_pretrained(DATA / family, dtype=torch.float32)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for label, path in (("folder", DATA / family), ("gguf", DATA / f"{family}.gguf")):
        llm = LLM(str(path), precise=True, kv_cache_dtype="f32")
        prompts = [llm.engine.tokenize(p) for p in PROMPTS]
        outs[label] = [list(r.outputs[0].token_ids) for r in llm.generate(prompts, params)]
        llm.engine.close()
    assert outs["folder"] == outs["gguf"]
    for p, ours in zip(prompts, outs["folder"], strict=True):
        assert_same_or_near_tie(ref.eval(), p, ours, hf_greedy(ref, p, 12))
