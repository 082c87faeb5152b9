"""The local engine as a chat backend: an `AsyncEngine` over one GGUF file.

Loading takes seconds, so `load` is blocking and the TUI calls it from a thread worker. The chat
template is rendered off the event loop too; `AsyncEngine.generate` aborts the request when the
consuming task is cancelled (stop generation).
"""

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from localllm.app.tui.backend import ChatDelta, GenSettings
from localllm.engine.async_engine import AsyncEngine
from localllm.engine.sampling.params import SamplingParams


def sampling_params(settings: GenSettings) -> SamplingParams:
    return SamplingParams(
        temperature=settings.temperature,
        top_p=settings.top_p,
        top_k=settings.top_k,
        min_p=settings.min_p,
        max_tokens=settings.max_tokens,
    )


class EngineBackend:
    def __init__(self, engine: AsyncEngine, name: str, model_bytes: int = 0):
        self.engine = engine
        self.name = name
        self.model_bytes = model_bytes

    @classmethod
    def load(cls, path: Path, **engine_args: Any) -> "EngineBackend":
        """Build the engine for `path` (blocking: call from a thread)."""
        engine = AsyncEngine.from_model(str(path), **engine_args)
        return cls(engine, Path(path).stem, Path(path).stat().st_size)

    @property
    def max_model_len(self) -> int | None:
        return self.engine.max_model_len

    async def stream(
        self, messages: Sequence[Mapping[str, str]], settings: GenSettings
    ) -> AsyncIterator[ChatDelta]:
        ids = await asyncio.to_thread(self.engine.engine.chat_prompt, list(messages))
        async for out in self.engine.generate(ids, sampling_params(settings)):
            if out.error:
                raise RuntimeError(out.error)
            c = out.outputs[0] if out.outputs else None
            yield ChatDelta(
                c.text if c else "",
                out.usage.prompt_tokens,
                out.usage.completion_tokens,
                c.finish_reason if c else None,
            )

    async def close(self) -> None:
        await asyncio.to_thread(self.engine.shutdown, True)
