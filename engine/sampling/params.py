"""What a request asks of generation: sampling controls, stops, logprobs, structured output.

Field names and defaults follow vLLM's `SamplingParams` so its users feel at home (temperature 1,
every filter off); `localllm run` passes llama.cpp's defaults explicitly. Every value is checked
here, so a bad request fails before it reaches the engine thread.
"""

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class StructuredOutputParams:
    """Exactly one constraint on the generated text (compiled by `engine.sampling.structured`)."""

    json: str | dict[str, Any] | None = None  # a JSON schema (dict or its JSON text)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # one of these strings, verbatim
    grammar: str | None = None  # GBNF (llama.cpp) or Lark-style EBNF

    def __post_init__(self):
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured choice must be a non-empty list of strings")
        given = [
            self.json is not None,
            self.json_object,
            self.regex is not None,
            self.choice is not None,
            self.grammar is not None,
        ]
        if sum(given) != 1:
            raise ValueError(
                "structured output takes exactly one of json, json_object, regex, choice, grammar"
            )


def _ids(value, name: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    out = tuple(value)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in out):
        raise ValueError(f"{name} must be a list of non-negative token ids")
    return out


@dataclass(frozen=True, slots=True)
class SamplingParams:
    n: int = 1  # completions per prompt; they share the prompt's KV blocks
    temperature: float = 1.0  # 0 means greedy (argmax)
    top_k: int = 0  # 0 or -1 disables
    top_p: float = 1.0  # 1.0 disables
    min_p: float = 0.0  # 0.0 disables
    typical_p: float = 1.0  # locally typical sampling; 1.0 disables
    repetition_penalty: float = 1.0  # >1 discourages tokens seen in prompt or output (CTRL rule)
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled
    banned_token_ids: tuple[int, ...] | None = None  # these never are
    seed: int | None = None  # per request: same seed, same tokens, whatever the batch
    stop: tuple[str, ...] = ()  # stop strings (matched on text, across token boundaries)
    stop_token_ids: tuple[int, ...] = ()  # extra ids that end generation (beside the EOG set)
    include_stop_str_in_output: bool = False
    max_tokens: int | None = 16  # None: until the context is full
    min_tokens: int = 0  # end-of-generation and stop ids are masked until this many
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: the sampled token's plus the top k
    prompt_logprobs: int | None = None  # same for every prompt token after the first
    skip_special_tokens: bool = True  # leave control tokens out of the text
    structured: StructuredOutputParams | None = None
    # LoRA adapters for this request: (adapter id, scale) pairs; None: the engine's global scales
    lora: tuple[tuple[int, float], ...] | None = None

    def __post_init__(self):
        s = object.__setattr__
        if isinstance(self.stop, str):
            s(self, "stop", (self.stop,))
        s(self, "stop", tuple(self.stop or ()))
        s(self, "stop_token_ids", _ids(self.stop_token_ids or (), "stop_token_ids"))
        s(self, "allowed_token_ids", _ids(self.allowed_token_ids, "allowed_token_ids"))
        s(self, "banned_token_ids", _ids(self.banned_token_ids, "banned_token_ids"))
        if self.top_k == -1:
            s(self, "top_k", 0)
        if self.logit_bias is not None:
            s(self, "logit_bias", {int(k): float(v) for k, v in self.logit_bias.items()})
        if self.lora is not None:
            s(self, "lora", tuple((i, float(v)) for i, v in self.lora))
        self._check()

    def _check(self) -> None:
        def bad(msg: str):
            raise ValueError(msg)

        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be >= 1, got {self.n}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            bad(f"top_k must be >= 0 (or -1 to disable), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.typical_p <= 1.0:
            bad(f"typical_p must be in (0, 1], got {self.typical_p}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -2.0 <= v <= 2.0):
                bad(f"{name} must be in [-2, 2], got {v}")
        if self.logit_bias is not None:
            for k, v in self.logit_bias.items():
                # OpenAI's range: +-100 already forces or bans a token; beyond it sums overflow.
                if k < 0 or not (math.isfinite(v) and -100.0 <= v <= 100.0):
                    bad(f"logit_bias needs token ids >= 0 and values in [-100, 100], got {k}: {v}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            bad("allowed_token_ids must not be empty")
        if not all(isinstance(x, str) and x for x in self.stop):
            bad("stop must be non-empty strings")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            bad(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= 20:
                bad(f"{name} must be in [0, 20], got {v}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
