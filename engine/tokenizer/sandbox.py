"""A jinja2 sandbox with resource limits, for chat templates taken from model files.

jinja2's `ImmutableSandboxedEnvironment` already blocks attribute escapes (`''.__class__`) and
mutation of lists and dicts. A template can still burn CPU or memory: nested loops with empty
bodies, doubling a string thirty times, `'a' * 10**10`, `x|indent(10**9)`, `2 ** (10**10)`.
`BoundedEnvironment` adds:

- a wall-clock deadline, checked on every call, attribute access, loop iteration, operator and
  output (every `{% for %}` iterates through a guard, wired in by rewriting the parsed template);
  compiling has one too, checked every few hundred tokens while lexing and parsing and every few
  hundred nodes while generating code, and the generated code is capped in size before Python's
  `compile()`, which cannot be interrupted;
- a size cap on every string or container a template can build, checked *before* the operations that
  multiply sizes (`+`, `*`, `%`, `~`, `**`, `join`, `replace`, `center`, `indent`, `wordwrap`,
  `format`, `tojson`) so that nothing huge is ever allocated;
- a memory budget for the filters and string methods that turn a string into one object per
  character, word or line (`|title`, `|sort`, `|list`, `.split()`, ...), checked before they run;
- unsafe attribute access raises at once instead of rendering as an empty string.

Limits are per render (thread-local), so one environment serves concurrent renders.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from localllm.engine.tokenizer.sandbox_checks import (
    FILTER_CHECKS,
    MAX_CODE_CHARS,
    MAX_FILTER_BYTES,
    MAX_POW_BITS,
    MAX_RANGE,
    STRING_FILTER_BYTES,
    TemplateLimitError,
    check_format,
    is_seq,
    string_method_bytes,
    tojson,
    value_size,
)

_LOOP_GUARD = "localllm_loop_guard"


class _Budget:
    def __init__(self, seconds: float, max_size: int, max_filter_bytes: int, what: str) -> None:
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.max_size = max_size
        self.max_filter_bytes = max_filter_bytes
        self.what = what  # "rendering" or "compiling", for the error


class _GenerationTag(Extension):
    """HF's `{% generation %}...{% endgeneration %}` (marks assistant text): renders the body."""

    tags = frozenset({"generation"})

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _LexDeadline(Extension):
    """Checks the deadline every 256 tokens while a template is lexed and parsed: the parser pulls
    the tokens one at a time through this filter, as rendering pulls loop items through a guard."""

    def filter_stream(self, stream: Any) -> Iterator[Any]:
        tick = self.environment.tick  # type: ignore[attr-defined]
        for i, token in enumerate(stream):
            if not i & 255:
                tick()
            yield token


class _Codegen(CodeGenerator):
    _visits = 0

    def visit(self, node: nodes.Node, *args: Any, **kwargs: Any) -> Any:
        # the deadline every 256 nodes while generating code (and folding constants)
        self._visits += 1
        if not self._visits & 255:
            self.environment.tick()  # type: ignore[attr-defined]
        return super().visit(node, *args, **kwargs)

    def visit_Concat(self, node: nodes.Concat, frame: Any) -> None:
        # `a ~ b` normally compiles to str_join((a, b)); route it through the size check.
        self.write("environment.bounded_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _GuardedIterable:
    """Wraps a `{% for %}` iterable: checks the deadline every few items, keeps `len()`."""

    def __init__(self, env: BoundedEnvironment, iterable: Iterable[Any]) -> None:
        self._env = env
        self._iterable = iterable

    def __len__(self) -> int:
        return len(self._iterable)  # type: ignore[arg-type]  # TypeError for generators, as jinja expects

    def __iter__(self) -> Iterator[Any]:
        for i, item in enumerate(self._iterable):
            if not i & 63:
                self._env.tick()
            yield item


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """An immutable sandbox with a deadline and a size cap; see the module docstring."""

    code_generator_class = _Codegen
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[loopcontrols, _GenerationTag, _LexDeadline],
            finalize=self._finalize,
            autoescape=False,
        )
        self._local = threading.local()
        self.globals.pop("lipsum", None)  # lipsum(n=10**6) would spin outside any check
        self.globals["range"] = self._range
        self.globals[_LOOP_GUARD] = lambda iterable: _GuardedIterable(self, iterable)
        self.filters = {name: self._guard_filter(name, f) for name, f in self.filters.items()}
        self.filters["tojson"] = self._guard_filter("tojson", tojson)
        self.concat = self._bounded_concat  # used for {% set %} blocks, macros and filter blocks

    # -- per-render budget ------------------------------------------------------------------------

    def start(
        self,
        time_limit_s: float,
        max_size: int,
        max_filter_bytes: int = MAX_FILTER_BYTES,
        what: str = "rendering",
    ) -> None:
        self._local.budget = _Budget(time_limit_s, max_size, max_filter_bytes, what)

    def stop(self) -> None:
        self._local.budget = None

    def _budget(self) -> _Budget | None:
        return getattr(self._local, "budget", None)

    def tick(self) -> None:
        budget = self._budget()
        if budget is not None and time.monotonic() > budget.deadline:
            phase = "compile" if budget.what == "compiling" else "render"
            raise TemplateLimitError(
                f"{budget.what} took longer than the {phase} time limit ({budget.seconds:g} s)"
            )

    def check_size(self, size: int, what: str) -> None:
        budget = self._budget()
        if budget is not None and size > budget.max_size:
            raise TemplateLimitError(f"{what} would exceed {budget.max_size} characters")

    def check_memory(self, nbytes: int, what: str) -> None:
        budget = self._budget()
        if budget is not None and nbytes > budget.max_filter_bytes:
            raise TemplateLimitError(
                f"{what} would take about {nbytes >> 20} MiB of memory "
                f"(limit {budget.max_filter_bytes >> 20} MiB)"
            )

    def limit(self) -> int:
        budget = self._budget()
        return budget.max_size if budget is not None else 1 << 62

    # -- hooks the sandbox calls ------------------------------------------------------------------

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            guard = nodes.Name(_LOOP_GUARD, "load")
            loop.iter = nodes.Call(guard, [loop.iter], [], None, None).set_lineno(loop.lineno)
        return tree

    def _compile(self, source: str, filename: str) -> Any:
        # Python's compile() runs in one call nothing can interrupt: bound what it gets
        if len(source) > MAX_CODE_CHARS:
            raise TemplateLimitError(
                f"the template makes {len(source)} characters of Python code "
                f"(limit {MAX_CODE_CHARS})"
            )
        self.tick()
        return super()._compile(source, filename)

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} is unsafe"
        )

    def getattr(self, obj: Any, attribute: str) -> Any:
        self.tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        self.tick()
        return super().getitem(obj, argument)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        __self.tick()
        target = getattr(__obj, "__wrapped__", __obj)
        owner = getattr(target, "__self__", None)
        if isinstance(owner, str):
            __self._check_str_method(owner, getattr(target, "__name__", ""), args, kwargs)
        __self._check_args(args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        __self.check_size(value_size(result, __self.limit()), "a value")
        return result

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        self.tick()
        limit = self.limit()
        if operator == "+" and is_seq(left) and is_seq(right):
            self.check_size(len(left) + len(right), "a concatenation")
        elif operator == "*":
            seq, n = (left, right) if is_seq(left) else (right, left)
            if is_seq(seq) and isinstance(n, int):
                self.check_size(len(seq) * max(n, 0), "a repetition")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            if right > 0 and abs(left) > 1 and right * math.log2(abs(left)) > MAX_POW_BITS:
                raise TemplateLimitError("a power would be astronomically large")
        elif operator == "%" and isinstance(left, str):
            check_format(left)
            args = right if isinstance(right, tuple | Mapping) else (right,)
            self.check_size(len(left) + value_size(args, limit), "a %-format")
        return super().call_binop(context, operator, left, right)

    def bounded_join(self, parts: Iterable[Any]) -> str:
        parts = list(parts)
        self.check_size(value_size(parts, self.limit()), "a ~ concatenation")
        return "".join(map(str, parts))

    def _bounded_concat(self, parts: Iterable[Any]) -> str:
        parts = list(parts)
        self.check_size(value_size(parts, self.limit()), "a captured block")
        return "".join(parts)

    def _finalize(self, value: Any) -> Any:
        self.tick()
        self.check_size(value_size(value, self.limit()), "an output value")
        return value

    def _range(self, *args: int) -> range:
        rng = range(*args)
        if len(rng) > MAX_RANGE:
            raise TemplateLimitError(f"range of {len(rng)} items (at most {MAX_RANGE})")
        return rng

    # -- argument checks --------------------------------------------------------------------------

    def _check_args(self, args: tuple, kwargs: dict) -> None:
        limit = self.limit()
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > limit:
                raise TemplateLimitError(f"integer argument {value} is too large")

    def _check_str_method(self, s: str, name: str, args: tuple, kwargs: dict) -> None:
        limit = self.limit()
        if name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
            self.check_size(args[0], f"str.{name}")
        elif name == "replace" and len(args) >= 2 and isinstance(args[0], str):
            count = s.count(args[0]) if args[0] else len(s) + 1
            self.check_size(len(s) + count * value_size(args[1], limit), "str.replace")
        elif name == "join" and args:
            items = args[0]
            n = len(items) if isinstance(items, list | tuple | str) else 0
            self.check_size(value_size(items, limit) + n * len(s), "str.join")
        elif name == "expandtabs":
            self.check_size(len(s) * (1 + (int(args[0]) if args else 8)), "str.expandtabs")
        elif name in ("format", "format_map"):
            check_format(s)
        self.check_memory(string_method_bytes(s, name, args, kwargs), f"str.{name}")

    def _guard_filter(self, name: str, fn: Any) -> Any:
        precheck = FILTER_CHECKS.get(name)
        per_char = STRING_FILTER_BYTES.get(name)

        @functools.wraps(fn)  # keeps jinja's pass_context/pass_environment marker
        def guarded(*args: Any, **kwargs: Any) -> Any:
            self.tick()
            values = [a for a in args if not _is_jinja_internal(a)]
            self._check_args(tuple(values[1:]), kwargs)
            if values:
                # Whatever a filter does, it should not start from a value past the cap.
                self.check_size(value_size(values[0], self.limit()), f"filter {name} input")
                if per_char is not None and isinstance(values[0], str):
                    n = len(values[0])
                    self.check_memory(per_char * n, f"filter {name} on {n} characters")
                if precheck is not None:
                    precheck(self, values[0], values[1:], kwargs)
            result = fn(*args, **kwargs)
            self.check_size(value_size(result, self.limit()), f"filter {name}")
            return result

        return guarded


def _is_jinja_internal(value: Any) -> bool:
    from jinja2.environment import Environment
    from jinja2.nodes import EvalContext
    from jinja2.runtime import Context

    return isinstance(value, Environment | Context | EvalContext)
