"""The local engine as a chat backend: an `AsyncEngine` over one GGUF file.

Loading takes seconds, so `load` is blocking and the TUI calls it from a thread worker. The chat
template is rendered off the event loop too; `AsyncEngine.generate` aborts the request when the
consuming task is cancelled (stop generation). With a vision projector (`mmproj`), messages
with attached images (`app/tui/images`) go through its `VisionPipeline`; without one they are
refused with a message that says how to load one.
"""

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from localllm.app.tui.backend import ChatDelta, GenSettings
from localllm.app.tui.images import parts, read_image
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
    def __init__(self, engine: AsyncEngine, name: str, model_bytes: int = 0, vision=None):
        self.engine = engine
        self.name = name
        self.model_bytes = model_bytes
        self.vision = vision  # a VisionPipeline, or None: text only

    @classmethod
    def load(cls, path: Path, mmproj: Path | None = None, **engine_args: Any) -> "EngineBackend":
        """Build the engine for `path` (blocking: call from a thread), with `mmproj`'s vision
        pipeline when given."""
        engine = AsyncEngine.from_model(str(path), **engine_args)
        vision = None
        if mmproj is not None:
            from localllm.media.vision.pipeline import VisionPipeline

            try:
                vision = VisionPipeline(mmproj, engine.engine)
            except BaseException:
                engine.shutdown(True)
                raise
        return cls(engine, Path(path).stem, Path(path).stat().st_size, vision)

    @property
    def max_model_len(self) -> int | None:
        return self.engine.max_model_len

    async def stream(
        self, messages: Sequence[Mapping[str, str]], settings: GenSettings
    ) -> AsyncIterator[ChatDelta]:
        ids, mm = await asyncio.to_thread(self._prompt, parts(list(messages)))
        async for out in self.engine.generate(ids, sampling_params(settings), mm_inputs=mm):
            if out.error:
                raise RuntimeError(out.error)
            c = out.outputs[0] if out.outputs else None
            yield ChatDelta(
                c.text if c else "",
                out.usage.prompt_tokens,
                out.usage.completion_tokens,
                c.finish_reason if c else None,
            )

    def _prompt(self, messages: list[dict]) -> tuple[list[int], list]:
        paths = [p["path"] for m in messages if isinstance(m["content"], list)
                 for p in m["content"] if p["type"] == "image"]  # fmt: skip
        if not paths:
            return self.engine.engine.chat_prompt(messages), []
        if self.vision is None:
            raise RuntimeError(
                f"{self.name} cannot see images: load a model pulled with its mmproj, or start "
                "localllm with -m MODEL --mmproj FILE"
            )
        images = [self.vision.prepare(read_image(p)) for p in paths]
        return self.vision.chat(self.engine.engine, [_typed(m) for m in messages], images)

    async def close(self) -> None:
        await asyncio.to_thread(self.engine.shutdown, True)
        if self.vision is not None:
            self.vision.close()


def _typed(m: dict) -> dict:
    """A message as the vision pipeline takes it: image parts without their paths."""
    if not isinstance(m["content"], list):
        return m
    return {**m, "content": [{"type": "image"} if p["type"] == "image" else p
                             for p in m["content"]]}  # fmt: skip
