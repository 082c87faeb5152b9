"""Text generation: GGUF reading, tokenizer and chat template, model families, the batched engine.

Public surface (vLLM-shaped): `LLM` (sync batch API), `AsyncEngine` (one engine thread, async
streams), `SamplingParams`, `StructuredOutputParams`, `EngineArgs`, `RequestOutput`; and
`Generator` (one-request scoring and streaming, the Foundation runner). Imported lazily so that
`import localllm.engine.<module>` stays cheap.
"""

import importlib

_EXPORTS = {
    "LLM": "localllm.engine.llm",
    "AsyncEngine": "localllm.engine.async_engine",
    "LLMEngine": "localllm.engine.llm_engine",
    "EngineArgs": "localllm.engine.config",
    "SamplingParams": "localllm.engine.sampling.params",
    "StructuredOutputParams": "localllm.engine.sampling.params",
    "RequestOutput": "localllm.engine.core.outputs",
    "CompletionOutput": "localllm.engine.core.outputs",
    "Generator": "localllm.engine.generator",
    "GenerationStats": "localllm.engine.generator",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'localllm.engine' has no attribute {name!r}")
