"""Shared helpers for the engine tests on the real SmolLM2 model."""

from localllm.engine import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three colours:",
    "Once upon a time, in a small village by the mountains, there lived an old clockmaker who",
    "Q: What is 12 times 7?\nA:",
    "The quick brown fox",
    "In 1969, the first humans",
    "Explain photosynthesis in one sentence.",
    "import numpy as np\nx = np.arange(10)\n",
    "My favourite food is",
    "Translate to French: good morning",
    "The three laws of thermodynamics are",
    "A short poem about autumn leaves falling slowly onto the quiet street:",
    "Hello",
    "Why is the sky blue? Answer briefly and mention Rayleigh scattering.",
]


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def texts(llm: LLM, prompts, params) -> list[str]:
    return [o.outputs[0].text for o in llm.generate(prompts, params)]


def ids(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def top2_gap(llm: LLM, prompt_ids: list[int]) -> float:
    """logprob(best) - logprob(second) of the next token after `prompt_ids` (near-tie check)."""
    out = llm.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=1, logprobs=2))
    lp = sorted((v.logprob for v in out[0].outputs[0].logprobs[0].values()), reverse=True)
    return lp[0] - lp[1]
