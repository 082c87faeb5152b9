"""Requests on different adapters (and none) in one engine step, each equal to its run alone.

Two adapters of the llama base loaded at once (a rank-8 PEFT folder and a rank-4 rsLoRA on other
targets). The same prompt (two full KV blocks) goes four ways: adapter 0, adapter 1, both at
other scales, none. Run together in one batch first, then each alone (the prefix cache then holds
the prompt's blocks under all four choices, so a block shared across adapters would show): every
request's greedy tokens are its alone run's and its log-probs agree to BATCH_TOL (other row
counts sum in other orders), so no KV block crossed adapters and no row took another's delta.
"""

import pytest

from localllm.engine.llm import LLM
from localllm.engine.lora import LoraSpec
from localllm.engine.sampling.params import SamplingParams
from tests.lora.lora_refs import HF, LORA, ids

BATCH_TOL = 1e-4
CHOICES = [((0, 1.0),), ((1, 1.0),), ((0, 0.5), (1, 2.0)), ()]


def _params(lora) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0,
                          lora=lora)  # fmt: skip


def _run(llm, prompts, choices):
    outs = llm.generate(prompts, [_params(c) for c in choices])
    return [(list(o.outputs[0].token_ids), _lps(o)) for o in outs]


def _lps(out) -> list[float]:
    c = out.outputs[0]
    return [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]


@pytest.mark.parametrize("base", ["llama", "llama.gguf"])
def test_mixed_adapters_in_one_batch_equal_each_alone(base):
    specs = (LoraSpec(str(LORA / "llama-a")), LoraSpec(str(LORA / "llama-b"), scale=0.0))
    prompt = ids(40, seed=7)  # two full KV blocks: the prefix cache is in play
    with LLM(str(HF / base), kv_cache_dtype="f32", lora=specs) as llm:
        together = _run(llm, [prompt] * len(CHOICES), CHOICES)
        alone = [_run(llm, [prompt], [c])[0] for c in CHOICES]  # the cache holds all four
    tokens = [t for t, _ in alone]
    assert len({tuple(t) for t in tokens}) == len(CHOICES)  # four different answers
    for (ta, la), (tb, lb) in zip(alone, together, strict=True):
        assert ta == tb
        assert max(abs(a - b) for a, b in zip(la, lb, strict=True)) < BATCH_TOL


def test_global_scales_apply_to_requests_naming_none():
    """lora=None takes the engine's global scales (--lora PATH:SCALE); an explicit list wins."""
    specs = (LoraSpec(str(LORA / "llama-a"), scale=1.0), LoraSpec(str(LORA / "llama-b"), 0.0))
    prompt = ids(14, seed=8)
    with LLM(str(HF / "llama"), kv_cache_dtype="f32", lora=specs) as llm:
        default = _run(llm, [prompt], [None])[0][0]
        assert default == _run(llm, [prompt], [((0, 1.0),)])[0][0]
        llm.engine.loras.set_scales([(1, 1.0)])
        assert _run(llm, [prompt], [None])[0][0] == _run(llm, [prompt], [((1, 1.0),)])[0][0]
        assert _run(llm, [prompt], [()])[0][0] != default


def test_embeddings_run_on_the_base_after_an_adapter_step():
    """An embedding forward between generation steps takes no adapter's delta (the row factors
    of the last step are not left on its rows)."""
    prompt = ids(12, seed=9)
    with LLM(str(HF / "llama"), kv_cache_dtype="f32") as base:
        want = base.engine.embed([prompt])[0].embedding
    specs = (LoraSpec(str(LORA / "llama-a")),)
    with LLM(str(HF / "llama"), kv_cache_dtype="f32", lora=specs) as llm:
        llm.generate([prompt], _params(((0, 1.0),)))
        got = llm.engine.embed([prompt])[0].embedding
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < BATCH_TOL
