"""Pydantic request models (OpenAI field names) and their translation into `SamplingParams`.

OpenAI's defaults differ from vLLM's: an omitted `max_tokens` means "until the context ends" and
temperature defaults to 1.0. Value checks beyond types stay in `SamplingParams` (one source).
"""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from localllm.app.server.lora import LoraEntry, pairs
from localllm.app.server.structured_fields import ResponseFormat, StructuredFields
from localllm.engine.sampling.params import SamplingParams, StructuredOutputParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(StructuredFields):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model_config = ConfigDict(populate_by_name=True)

    model: str | None = None
    n: int = 1
    best_of: int | None = None  # accepted only as n: candidates beyond n are not made
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    typical_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(default=None, min_length=1)  # vLLM: a salt, never ""
    lora: list[LoraEntry] | None = None  # llama-server's per-request [{"id", "scale"}]
    user: str | None = None

    def sampling_params(
        self,
        *,
        max_tokens: int | None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        structured: StructuredOutputParams | None = None,
    ) -> SamplingParams:
        def pick(value, default):
            return default if value is None else value

        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(
                f"best_of={self.best_of} is not supported: this server returns every completion "
                "it makes, so best_of must equal n (or be left out)"
            )

        bias = None
        if self.logit_bias:
            try:
                bias = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError:
                raise ValueError("logit_bias keys must be token ids (integer strings)") from None
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        return SamplingParams(
            n=self.n,
            temperature=pick(self.temperature, 1.0),
            top_p=pick(self.top_p, 1.0),
            top_k=pick(self.top_k, 0),
            min_p=pick(self.min_p, 0.0),
            typical_p=pick(self.typical_p, 1.0),
            presence_penalty=pick(self.presence_penalty, 0.0),
            frequency_penalty=pick(self.frequency_penalty, 0.0),
            repetition_penalty=pick(self.repetition_penalty, 1.0),
            logit_bias=bias,
            seed=self.seed,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            include_stop_str_in_output=self.include_stop_str_in_output,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured=structured,
            lora=pairs(self.lora),
        )


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... reach the template

    role: str
    content: str | list[dict[str, Any]] | None = None

    def for_template(self) -> dict[str, Any]:
        """The message for the chat template: text parts joined into one string, or, when it
        has images, typed parts with each image as `{"type": "image", "url": URL}` (the URL is
        taken out by `chat_prep` before anything is rendered)."""
        msg = self.model_dump(exclude_none=True)
        if not isinstance(self.content, list):
            return msg
        parts = [_content_part(p) for p in self.content]
        if any(p["type"] in ("image", "video") for p in parts):
            msg["content"] = parts
        else:
            msg["content"] = "".join(p["text"] for p in parts)
        return msg


def _content_part(part: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI content part as the template sees it: text, or an image (from `image_url`)."""
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise ValueError("a text content part needs a string 'text'")
        return {"type": "text", "text": part["text"]}
    if kind == "image_url":
        ref = part.get("image_url")
        url = ref.get("url") if isinstance(ref, dict) else ref  # vLLM also takes a bare string
        if not isinstance(url, str) or not url:
            raise ValueError("an image_url content part needs image_url.url (a data: or http URL)")
        return {"type": "image", "url": url}
    if kind == "video_url":  # vLLM's video part
        ref = part.get("video_url")
        url = ref.get("url") if isinstance(ref, dict) else ref
        if not isinstance(url, str) or not url:
            raise ValueError("a video_url content part needs video_url.url (a data: or http URL)")
        return {"type": "video", "url": url}
    raise ValueError(
        f"content parts of type {kind!r} are not supported in chat messages "
        "(supported: text, image_url, video_url)"
    )


class FunctionSpec(BaseModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class ToolSpec(BaseModel):
    type: Literal["function"]
    function: FunctionSpec

    def as_dict(self) -> dict[str, Any]:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: dict[str, str]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: StrictBool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None  # forced calls: one unless this is true
    # vLLM's fields. Unset: a trailing assistant message is continued (llama-server's prefill).
    continue_final_message: StrictBool | None = None
    add_generation_prompt: StrictBool | None = None

    def continue_final(self) -> bool | None:
        """Whether to continue the last message (None: decide by its role)."""
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if self.continue_final_message is not None:
            return self.continue_final_message
        return None if self.add_generation_prompt is None else False

    def template_kwargs(self) -> dict[str, Any]:
        kwargs = dict(self.chat_template_kwargs or {})
        if self.add_generation_prompt is not None:
            kwargs["add_generation_prompt"] = self.add_generation_prompt
        return kwargs

    def tool_dicts(self) -> list[dict[str, Any]]:
        return [t.as_dict() for t in self.tools or ()]

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self.sampling_params(
            max_tokens=self.max_completion_tokens or self.max_tokens,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
            structured=self.structured(self.response_format),
        )


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    echo: StrictBool = False
    logprobs: int | None = None
    response_format: ResponseFormat | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)

    def to_sampling_params(self) -> SamplingParams:
        # Legacy completions default to 16 tokens in OpenAI's API; we follow the brief: to the end.
        return self.sampling_params(
            max_tokens=self.max_tokens,
            logprobs=self.logprobs,
            prompt_logprobs=self.logprobs if self.echo and self.logprobs is not None else None,
            structured=self.structured(self.response_format),
        )


class TokenizeRequest(BaseModel):
    content: str
    add_special: StrictBool = True
    with_pieces: StrictBool = False


class DetokenizeRequest(BaseModel):
    tokens: list[int]
