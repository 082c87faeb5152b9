"""`LLM`: the synchronous batch API, shaped like vLLM's (`generate`, `chat`).

llm = LLM(model="model.gguf", max_num_seqs=8)
outs = llm.generate(["Hello", "The sky is"], SamplingParams(temperature=0, max_tokens=32))
outs[0].outputs[0].text
"""

from collections.abc import Mapping, Sequence
from typing import Any

from localllm.engine.config import EngineArgs
from localllm.engine.core.outputs import RequestOutput
from localllm.engine.llm_engine import LLMEngine
from localllm.engine.sampling.params import SamplingParams

Prompt = str | Sequence[int] | Mapping[str, Any]  # text, token ids, or {"prompt_token_ids": [...]}


class LLM:
    def __init__(self, model: str, **engine_args: Any):
        self.engine = LLMEngine(model, EngineArgs(**engine_args))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in the order given."""
        items = _as_list(prompts)
        params = _params_for(items, sampling_params)
        return self._run([(_ids_or_text(p), sp) for p, sp in zip(items, params, strict=True)])

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        params = _params_for(convs, sampling_params)
        kw = dict(chat_template_kwargs or {})
        prompts = [
            self.engine.chat_prompt(
                c, add_generation_prompt=add_generation_prompt, tools=tools, **kw
            )
            for c in convs
        ]
        return self._run(list(zip(prompts, params, strict=True)))

    def _run(self, work: list[tuple[str | list[int], SamplingParams]]) -> list[RequestOutput]:
        ids = []
        try:
            for prompt, sp in work:
                ids.append(self.engine.add_request(None, prompt, sp))
        except BaseException:
            self.engine.abort_request(ids)
            while self.engine.has_unfinished_requests():
                self.engine.step()
            raise
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _as_list(prompts) -> list:
    if isinstance(prompts, str | Mapping):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _ids_or_text(p: Prompt) -> str | list[int]:
    if isinstance(p, Mapping):
        if "prompt_token_ids" in p:
            return list(p["prompt_token_ids"])
        return p["prompt"]
    return p if isinstance(p, str) else list(p)


def _params_for(items: list, params) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * len(items)
    if isinstance(params, SamplingParams):
        return [params] * len(items)
    params = list(params)
    if len(params) != len(items):
        raise ValueError(f"{len(items)} prompts but {len(params)} sampling params")
    return params
