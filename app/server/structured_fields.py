"""Every peer API's spelling of a structured-output constraint, read into one
`StructuredOutputParams`, so no constraint a client sends is silently dropped.

- OpenAI: `response_format` (`json_object`, `json_schema`), and llama-server's
  `{"type": "json_object", "schema": {...}}`.
- vLLM: `structured_outputs: {json, regex, choice, grammar, json_object}` and the older
  `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`.
- llama-server: `grammar` (GBNF) and `json_schema`.

A request may give one constraint; two are a 400, as are options we cannot honour
(`structural_tag`, `whitespace_pattern`, ...). Backend choices (`guided_decoding_backend`,
`disable_fallback`) are accepted: there is one backend, llguidance, and no fallback.
"""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from localllm.engine.sampling.params import StructuredOutputParams


class JsonSchemaSpec(BaseModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # llama-server's


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` object; unknown keys are a 400, never ignored."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None
    disable_any_whitespace: StrictBool = False  # JSON without whitespace between tokens
    disable_fallback: StrictBool = False  # one backend: there is nothing to fall back to
    # Options we cannot honour: present and set, they are a 400 rather than a silent no.
    structural_tag: Any = None
    whitespace_pattern: str | None = None
    disable_additional_properties: StrictBool | None = None

    def constraints(self) -> dict[str, StructuredOutputParams]:
        for name in ("structural_tag", "whitespace_pattern", "disable_additional_properties"):
            if getattr(self, name) not in (None, False):
                raise ValueError(f"structured_outputs.{name} is not supported by this server")
        out = {}
        if self.json_ is not None:
            out["structured_outputs.json"] = StructuredOutputParams(
                json=_compact(self.json_) if self.disable_any_whitespace else self.json_
            )
        if self.json_object:
            schema = {"type": "object"}
            out["structured_outputs.json_object"] = StructuredOutputParams(
                **({"json": _compact(schema)} if self.disable_any_whitespace else
                   {"json_object": True})
            )  # fmt: skip
        if self.regex is not None:
            out["structured_outputs.regex"] = StructuredOutputParams(regex=self.regex)
        if self.choice is not None:
            out["structured_outputs.choice"] = StructuredOutputParams(choice=tuple(self.choice))
        if self.grammar is not None:
            out["structured_outputs.grammar"] = StructuredOutputParams(grammar=self.grammar)
        if not out:
            raise ValueError("structured_outputs names no constraint (json, regex, choice, ...)")
        return out


def _compact(schema: dict[str, Any] | str) -> dict[str, Any] | str:
    """The schema with llguidance told to allow no whitespace between JSON tokens."""
    if not isinstance(schema, dict):
        raise ValueError("disable_any_whitespace needs the JSON schema as an object")
    guidance = {**schema.get("x-guidance", {}), "whitespace_flexible": False}
    return {**schema, "x-guidance": guidance}


class StructuredFields(BaseModel):
    """The constraint fields a generation request may carry, beside `response_format`."""

    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted: the backend is always llguidance
    guided_whitespace_pattern: str | None = None
    grammar: str | None = None  # llama-server: GBNF
    json_schema: dict[str, Any] | None = None  # llama-server

    def structured(self, response_format: ResponseFormat | None) -> StructuredOutputParams | None:
        """The request's one constraint (None: none); ValueError for two or an unsupported
        option."""
        if self.guided_whitespace_pattern is not None:
            raise ValueError("guided_whitespace_pattern is not supported by this server")
        given: dict[str, StructuredOutputParams] = {}
        fmt = from_response_format(response_format)
        if fmt is not None:
            given["response_format"] = fmt
        if self.structured_outputs is not None:
            given.update(self.structured_outputs.constraints())
        single = {
            "guided_json": lambda v: StructuredOutputParams(json=v),
            "guided_regex": lambda v: StructuredOutputParams(regex=v),
            "guided_choice": lambda v: StructuredOutputParams(choice=tuple(v)),
            "guided_grammar": lambda v: StructuredOutputParams(grammar=v),
            "grammar": lambda v: StructuredOutputParams(grammar=v),
            "json_schema": lambda v: StructuredOutputParams(json=v),
        }
        for name, make in single.items():
            value = getattr(self, name)
            if value is not None:
                given[name] = make(value)
        if len(given) > 1:
            names = " and ".join(sorted(given))
            raise ValueError(f"give one structured-output constraint, not {names}")
        return next(iter(given.values()), None)


def from_response_format(fmt: ResponseFormat | None) -> StructuredOutputParams | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        if fmt.schema_ is not None:
            return StructuredOutputParams(json=fmt.schema_)
        return StructuredOutputParams(json_object=True)
    schema = fmt.json_schema.schema_ if fmt.json_schema is not None else fmt.schema_
    if schema is None:
        raise ValueError("response_format json_schema needs json_schema.schema")
    return StructuredOutputParams(json=schema)
