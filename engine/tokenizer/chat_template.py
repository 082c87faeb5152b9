"""Chat templates: a GGUF's `tokenizer.chat_template` rendered with Hugging Face's conventions.

The template is untrusted input (it comes from a downloaded model file), so it runs in
`BoundedEnvironment`: jinja2's immutable sandbox plus a deadline and a size cap. Whatever goes wrong
(syntax error, sandbox violation, `raise_exception(...)` from the template, a limit) surfaces as one
`ChatTemplateError`.

Limits (defaults; `ChatTemplate`'s keywords change them): the template's source at most
MAX_SOURCE_CHARS (256 Ki characters); compiling at most 1 s (`compile_time_limit_s`) and 2 Mi
characters of generated code (`sandbox_checks.MAX_CODE_CHARS`); rendering at most 2 s
(`time_limit_s`) and 4 M characters of output, or twice the prompt data when that is more
(`max_output_chars`); one filter or string method that explodes a string into objects at most
64 MiB (`max_filter_bytes`).

Context given to templates, as transformers' `apply_chat_template` does: `messages`,
`add_generation_prompt`, `bos_token`, `eos_token`, `tools`, `documents`, any extra keyword (e.g.
`enable_thinking`), and the helpers `raise_exception(msg)`, `strftime_now(fmt)` and the `tojson`
filter (unescaped, with `indent`/`sort_keys`/`separators`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from localllm.engine.tokenizer.sandbox import BoundedEnvironment
from localllm.engine.tokenizer.sandbox_checks import (
    MAX_FILTER_BYTES,
    TemplateLimitError,
    value_size,
)

if TYPE_CHECKING:
    from localllm.engine.tokenizer.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Used only when a model has no template and the caller asks for chat anyway.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

MAX_SOURCE_CHARS = 256 * 1024  # 15x the largest real template we know (gpt-oss: 17 KB)
COMPILE_TIME_LIMIT_S = 1.0  # gpt-oss's template compiles in 0.04 s
RENDER_TIME_LIMIT_S = 2.0
MAX_OUTPUT_CHARS = 4_000_000


class ChatTemplateError(ValueError):
    """The chat template could not be compiled or rendered."""


class _RaisedByTemplate(Exception):
    """`raise_exception()` called by the template: its message is for the user as is."""


def _raise_exception(message: str = "") -> None:
    raise _RaisedByTemplate(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(str(fmt))


class ChatTemplate:
    """A compiled chat template. `render` may be called from several threads at once."""

    def __init__(
        self,
        source: str,
        bos_token: str | None = None,
        eos_token: str | None = None,
        *,
        time_limit_s: float = RENDER_TIME_LIMIT_S,
        max_output_chars: int = MAX_OUTPUT_CHARS,
        compile_time_limit_s: float = COMPILE_TIME_LIMIT_S,
        max_filter_bytes: int = MAX_FILTER_BYTES,
    ) -> None:
        if not isinstance(source, str):
            raise ChatTemplateError("chat template must be a string")
        if len(source) > MAX_SOURCE_CHARS:
            raise ChatTemplateError(
                f"chat template is {len(source)} characters (limit {MAX_SOURCE_CHARS})"
            )
        self.source = source
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self.time_limit_s = time_limit_s
        self.max_output_chars = max_output_chars
        self.max_filter_bytes = max_filter_bytes
        self._env = BoundedEnvironment()
        self._env.globals["raise_exception"] = _raise_exception
        self._env.globals["strftime_now"] = _strftime_now
        # compiling evaluates constants too: the size caps apply, and a deadline of its own
        self._env.start(compile_time_limit_s, max_output_chars, max_filter_bytes, "compiling")
        try:
            self._template = self._env.from_string(source)
        except Exception as e:  # syntax errors, and whatever a hostile source makes the parser do
            raise ChatTemplateError(f"chat template does not compile: {_describe(e)}") from e
        finally:
            self._env.stop()

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, **limits: Any) -> ChatTemplate:
        """The model's own template, or ChatML (with a warning) when the GGUF has none.

        Call this only when the caller wants chat: a model without a template may be a base model.
        """
        bos = tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
        eos = tokenizer.token_text(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
        source = tokenizer.chat_template
        if source is None:
            log.warning("model has no chat template; using ChatML")
            source = CHATML_TEMPLATE
        return cls(source, bos, eos, **limits)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for `messages` (a list of {"role", "content", ...} mappings)."""
        if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
            raise ChatTemplateError("messages must be a list of mappings")
        if not all(isinstance(m, Mapping) for m in messages):
            raise ChatTemplateError("every message must be a mapping with 'role' and 'content'")
        context = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "documents": None,
            **extra,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "tools": tools,
        }
        # Room for the prompt data itself plus the template's own text, at least the set cap. The
        # estimate stops counting at 16x the cap, which also bounds its own work.
        input_size = value_size(context, 16 * self.max_output_chars)
        limit = max(self.max_output_chars, 2 * input_size + len(self.source))
        self._env.start(self.time_limit_s, limit, self.max_filter_bytes)
        try:
            out: list[str] = []
            total = 0
            for chunk in self._template.generate(context):
                total += len(chunk)
                if total > limit:
                    raise TemplateLimitError(f"output exceeds {limit} characters")
                out.append(chunk)
            return "".join(out)
        except _RaisedByTemplate as e:
            raise ChatTemplateError(f"chat template refused the conversation: {e}") from None
        except ChatTemplateError:
            raise
        except Exception as e:  # sandbox violations, limits, type errors in the template, ...
            raise ChatTemplateError(f"chat template failed: {_describe(e)}") from e
        finally:
            self._env.stop()


def _describe(e: BaseException) -> str:
    text = str(e)
    if len(text) > 300:
        text = text[:300] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
