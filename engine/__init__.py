"""Text generation: GGUF reading, tokenizer and chat template, model families, sampling.

Public surface: `Generator` (load a GGUF, score, stream tokens) and `SamplingParams`.
"""

from localllm.engine.generator import GenerationStats, Generator
from localllm.engine.sampling import SamplingParams

__all__ = ["GenerationStats", "Generator", "SamplingParams"]
