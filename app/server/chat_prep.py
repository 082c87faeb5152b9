"""A chat request made ready for the engine: prompt ids, final sampling params, how to read output.

Shared by /v1/chat/completions, /v1/responses and /v1/messages: tools go into the prompt (template
variable or system text), forced tool choices become a grammar, and the rendered prompt tells
whether generation starts inside a think block.
"""

import asyncio
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from localllm.app.server import glm_tools
from localllm.app.server.chat_output import OutputPlan
from localllm.app.server.common import check_context_chars, prompt_chars
from localllm.app.server.errors import APIError
from localllm.app.server.media_inputs import load_image, media_kinds, take_images, vision_of
from localllm.app.server.reasoning import opens_thinking
from localllm.app.server.settings import ServerSettings
from localllm.app.server.tool_parsers import FORMATS, GLM, HARMONY, ToolFormat, detect_format
from localllm.app.server.tool_prompt import (
    TemplateTraits,
    call_grammar,
    pick_tools,
    prompt_messages,
)
from localllm.engine.sampling.params import SamplingParams, StructuredOutputParams


@dataclass(frozen=True, slots=True)
class PreparedChat:
    messages: list[dict]  # for the chat template
    tools: list[dict] | None  # the template's `tools` variable
    params: SamplingParams
    plan: OutputPlan
    template_kwargs: dict[str, Any]
    continue_final: bool = False  # the prompt ends inside the last (assistant) message
    prompt: tuple[list[int], list] | None = None  # with images: ids and their MultiModalInputs

    def stream(self, engine, request_id: str, cache_salt: str | None = None):
        if self.prompt is not None:
            ids, mm = self.prompt
            return engine.generate(
                ids, self.params, request_id, cache_salt=cache_salt, mm_inputs=mm
            )
        return engine.chat(
            self.messages,
            self.params,
            request_id,
            tools=self.tools,
            chat_template_kwargs=self.template_kwargs,
            cache_salt=cache_salt,
            continue_final=self.continue_final,
        )


@dataclass(frozen=True, slots=True)
class ToolRequest:
    tools: list[dict]  # OpenAI shape: {"type": "function", "function": {name, parameters, ...}}
    choice: str | dict | None = None
    parallel: bool = False  # several calls in one forced answer


def _marker_ids(tokenizer, texts) -> dict[str, int]:
    """The format's markers that are one token each (its grammar names those by id)."""
    out = {}
    for t in texts:
        ids = tokenizer.encode(t, add_special=False, parse_special=True)
        if len(ids) == 1:
            out[t] = ids[0]
    return out


def _trigger_token(tokenizer, fmt: ToolFormat) -> tuple[int | None, bool]:
    """(id of the family's opening marker when it is one token, whether decoding hides it)."""
    ids = tokenizer.encode(fmt.trigger, add_special=False, parse_special=True)
    if len(ids) != 1:
        return None, False
    return ids[0], tokenizer.is_special(ids[0])


# Names the chat call itself passes; a request's template kwargs may not reuse them.
RESERVED_KWARGS = frozenset({"messages", "tools", "self", "continue_final"})


def continues(messages: list[dict], asked: bool | None) -> bool:
    """Whether generation continues the last message: as asked, else when it is an assistant's
    text without tool calls (an answer begun by the caller: llama-server's assistant prefill)."""
    if asked is not None:
        return asked
    last = messages[-1] if messages else {}
    return last.get("role") == "assistant" and not last.get("tool_calls")


def described(tool: dict) -> dict:
    """A tool with a `description`, empty where the client left it out."""
    fn = tool.get("function") or {}
    if isinstance(fn.get("description"), str):
        return tool
    return {**tool, "function": {**fn, "description": ""}}


async def prepare_chat(
    engine,
    settings: ServerSettings,
    messages: list[dict],
    params: SamplingParams,
    tools: ToolRequest | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    continue_final: bool | None = None,
) -> PreparedChat:
    """Render and check one chat request; ValueError (a 400) for bad tools or tool_choice.

    `continue_final`: continue the last message (None: when it is an assistant's, see
    `continues`)."""
    kwargs = dict(template_kwargs or {})
    clash = sorted(RESERVED_KWARGS & kwargs.keys())
    if clash:
        raise ValueError(
            f"chat_template_kwargs may not set {clash[0]!r}: the request's own fields do"
        )
    if "add_generation_prompt" in kwargs and continue_final is None:
        continue_final = False  # said either way, it means a closed last turn
    messages, urls = take_images(messages)  # (before counting: a data URL is not prompt text)
    kinds = media_kinds(messages)
    vision = _vision_for(engine, settings, kinds)
    check_context_chars(engine, prompt_chars(messages))
    cont = continues(messages, continue_final)
    if cont:
        kwargs.pop("add_generation_prompt", None)
    tok = engine.tokenizer
    source = tok.chat_template if tok is not None else None
    fmt = FORMATS[settings.tool_format] if settings.tool_format else detect_format(source)
    given = tools.tools if tools else []
    choice = tools.choice if tools else None
    if choice not in (None, "none", "auto") and not given:
        raise ValueError("tool_choice needs tools")
    if fmt is HARMONY:  # gpt-oss's template writes `"// " + tool.description`, absent or not
        given = [described(t) for t in given]
    allowed, forced = pick_tools(given, choice)
    active = bool(allowed)
    msgs, template_tools = prompt_messages(
        messages, given if active else None, TemplateTraits.of(source), fmt
    )
    in_think = False
    prompt = None
    if urls:
        prompt = await _image_prompt(
            engine, settings, vision, list(zip(kinds, urls, strict=True)), msgs, template_tools,
            cont, kwargs,
        )  # fmt: skip
        in_think = opens_thinking(tok.decode(prompt[0][-8:]))
    elif settings.reasoning_format != "none" and "<think>" in (source or ""):
        # Only thinking templates can open a block in the prompt: render to see its end.
        ids = await asyncio.to_thread(
            engine.engine.chat_prompt, msgs, tools=template_tools, continue_final=cont, **kwargs
        )
        in_think = opens_thinking(tok.decode(ids[-8:]))
    trigger, hidden = _trigger_token(tok, fmt) if active else (None, False)
    if active:
        markers = _marker_ids(tok, glm_tools.MARKERS) if fmt is GLM else {}
        hidden = hidden or any(tok.is_special(i) for i in markers.values())
        parallel = bool(tools and tools.parallel)
        grammar = call_grammar(fmt, allowed, parallel, trigger, markers)
        spec = StructuredOutputParams(grammar=grammar)
        try:  # the grammar is also the schema check: a tool llguidance cannot compile is a 400
            await asyncio.to_thread(engine.engine.grammars.compile, spec)
        except ValueError as e:
            raise ValueError(f"tools: a function's parameters do not compile: {e}") from None
        if forced:
            if params.structured is not None:
                raise ValueError("response_format cannot be combined with a forced tool_choice")
            params = dataclasses.replace(params, structured=spec)
        if hidden:  # the marker is a control token: keep it in the text, where parsing sees it
            params = dataclasses.replace(params, skip_special_tokens=False)
    plan = OutputPlan(
        # A forced call starts the answer: the grammar leaves no room for a think block.
        reasoning=settings.reasoning_format != "none" and not forced,
        in_think=in_think and not forced,
        tools=fmt if active else None,
        tool_params={t["function"]["name"]: t["function"].get("parameters") for t in given},
        harmony=fmt is HARMONY,  # its channels are read even without tools (a continued answer)
    )
    return PreparedChat(msgs, template_tools, params, plan, kwargs, cont, prompt)


def _vision_for(engine, settings: ServerSettings, kinds: list[str]):
    """The engine's vision pipeline when the request has images or videos (400 when it has
    none)."""
    n_images, n_videos = kinds.count("image"), kinds.count("video")
    if not kinds:
        return None
    vision = vision_of(engine)
    if vision is None:
        raise APIError(
            400,
            "this model does not take images: it is served without a vision projector "
            "(start the server with --mmproj FILE, the model's mmproj)",
            param="messages",
        )
    if n_images > settings.max_images_per_prompt:
        raise APIError(
            400,
            f"{n_images} images in one request, more than the {settings.max_images_per_prompt} "
            "allowed (--limit-mm-per-prompt image=N)",
            param="messages",
        )
    if n_videos > settings.max_videos_per_prompt:
        raise APIError(
            400,
            f"{n_videos} videos in one request, more than the {settings.max_videos_per_prompt} "
            "allowed (--limit-mm-per-prompt video=M)",
            param="messages",
        )
    return vision


async def _image_prompt(engine, settings, vision, media, msgs, tools, cont, kwargs):
    """(ids, image spans): the images and videos (`media`: (kind, URL) pairs) read, then
    decoded and laid into the rendered prompt off the event loop (an ImageError, or a
    VideoError, is a ValueError: a 400)."""
    caps = {"image": settings.max_image_bytes, "video": settings.max_video_bytes}
    blobs = await asyncio.gather(*(load_image(u, settings, caps[k]) for k, u in media))

    def build():
        images = [
            vision.prepare_video(b) if k == "video" else vision.prepare(b)
            for (k, _), b in zip(media, blobs, strict=True)
        ]
        return vision.chat(engine.engine, msgs, images, tools=tools, continue_final=cont, **kwargs)

    return await asyncio.to_thread(build)
