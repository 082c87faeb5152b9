"""Structured output: a request's `StructuredOutputParams` turned into a per-request token matcher.

`GrammarCompiler` (one per model) turns a JSON schema, "any JSON object", a regex, a list of
choices or a GBNF / Lark grammar into a llguidance grammar and checks it up front: a bad spec is a
`StructuredOutputError` naming the problem before the request is queued. `Grammar.matcher()` gives
each request its own `GrammarMatcher`, which the sampler asks for the allowed-token mask and tells
about each chosen token. llguidance's parser limits bound the work per grammar and per step, so a
hostile schema fails fast instead of hanging the engine thread.
"""

from __future__ import annotations

import json
import re
import threading

import llguidance
import numpy as np
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax

from localllm.engine.sampling.params import StructuredOutputParams
from localllm.engine.sampling.structured_vocab import build_lltokenizer
from localllm.engine.tokenizer import Tokenizer

MAX_SPEC_CHARS = 1 << 20  # larger schemas / grammars are refused before any parsing
# Whitespace between JSON tokens: at most 16 characters per gap, enough for pretty-printing,
# and a model cannot loop on blanks forever. A schema's own "x-guidance" options override this.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{1,16}"
# Safe (alphanumeric) characters stay literal in a choice regex; anything else is hex-escaped.
_REGEX_SAFE = re.compile(r"[0-9A-Za-z_]")


class StructuredOutputError(ValueError):
    """The structured-output spec is malformed, unsupported, too large, or matches nothing."""


def _limits() -> llguidance.LLParserLimits:
    # llguidance's defaults, except fewer lexer states (each costs 1-2 kB) and terse runtime
    # errors (the verbose form dumps the whole grammar into the request's error).
    return llguidance.LLParserLimits(
        max_items_in_row=2000,
        initial_lexer_fuel=1_000_000,  # ~20 ms of regex analysis at compile time
        step_lexer_fuel=200_000,  # ~15 ms per mask at most
        step_max_items=50_000,
        max_lexer_states=50_000,
        max_grammar_size=200_000,
        verbose_errors=False,
    )


def choice_regex(options: tuple[str, ...]) -> str:
    """A regex matching exactly one of `options`: llguidance's (Rust) regex syntax rejects some
    of Python's escapes, so every non-alphanumeric character is written as `\\x{..}`."""

    def esc(s: str) -> str:
        return "".join(c if _REGEX_SAFE.fullmatch(c) else f"\\x{{{ord(c):x}}}" for c in s)

    return "(?:" + "|".join(esc(o) for o in options) + ")"


def _check_size(text: str, what: str) -> None:
    if len(text) > MAX_SPEC_CHARS:
        raise StructuredOutputError(f"{what} is too large ({len(text)} > {MAX_SPEC_CHARS} chars)")


def _schema_grammar(schema: str | dict, what: str) -> str:
    if isinstance(schema, str):
        _check_size(schema, what)
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as e:
            raise StructuredOutputError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise StructuredOutputError(f"{what} must be a JSON object, not {type(schema).__name__}")
    try:
        text = json.dumps(schema)
    except (ValueError, TypeError, RecursionError) as e:
        raise StructuredOutputError(f"{what} cannot be written as JSON: {e}") from None
    _check_size(text, what)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_pattern": JSON_WHITESPACE}
        )
    except (ValueError, TypeError, RecursionError) as e:
        raise StructuredOutputError(f"{what} is not a valid JSON schema: {e}") from None


def _grammar_text(text: str) -> tuple[str, str]:
    """(llguidance grammar, name of its syntax) for a GBNF or Lark grammar."""
    _check_size(text, "grammar")
    if not is_lark_syntax(text) and "::=" in text:
        try:
            return llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(text)), "GBNF grammar"
        except Exception as e:  # the converter is plain Python: any parse failure is the user's
            raise StructuredOutputError(f"GBNF grammar syntax error: {e}") from None
    return llguidance.LLMatcher.grammar_from_lark(text), "Lark grammar"


def to_llguidance(spec: StructuredOutputParams) -> tuple[str, str]:
    """(llguidance grammar text, what it is, for error messages) for one spec."""
    if spec.json is not None:
        return _schema_grammar(spec.json, "JSON schema"), "JSON schema"
    if spec.json_object:
        return _schema_grammar({"type": "object"}, "JSON object"), "JSON object"
    if spec.regex is not None:
        _check_size(spec.regex, "regex")
        return llguidance.LLMatcher.grammar_from_regex(spec.regex), "regex"
    if spec.choice is not None:
        _check_size("".join(spec.choice), "choice list")
        return llguidance.LLMatcher.grammar_from_regex(choice_regex(spec.choice)), "choice"
    if spec.grammar is not None:
        return _grammar_text(spec.grammar)
    raise StructuredOutputError("empty structured output spec")  # the dataclass forbids this


class GrammarCompiler:
    """Compiles specs against one model's vocabulary. The llguidance token table takes ~0.4 s
    (49k tokens) to 1-2.5 s (262k) to build: it is built on the first `compile` (or `warm_up`)
    and kept."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        if vocab_size < tokenizer.vocab_size:
            raise ValueError(
                f"vocab_size {vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size}"
            )
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lltok: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def warm_up(self) -> None:
        """Build the token table now (e.g. in a thread while weights load)."""
        _ = self.lltokenizer

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary, built once."""
        if self._lltok is None:
            with self._lock:
                if self._lltok is None:
                    self._lltok = build_lltokenizer(self._tokenizer, self.vocab_size)
        return self._lltok

    def compile(self, spec: StructuredOutputParams) -> Grammar:
        """Check and compile `spec`; raises `StructuredOutputError` saying what is wrong."""
        grammar, what = to_llguidance(spec)
        lltok = self.lltokenizer
        ll = llguidance.LLMatcher(lltok, grammar, log_level=0, limits=_limits())
        if ll.is_error():
            raise StructuredOutputError(f"invalid {what}: {ll.get_error().strip()}")
        matcher = GrammarMatcher(ll, self.vocab_size, tuple(lltok.eos_tokens))
        matcher.bitmask()  # the first mask can fail too: an empty language, a lexer limit
        error = matcher.error
        if error is not None and not error.startswith("NoExtension"):
            raise StructuredOutputError(f"the {what} is too complex: {error.splitlines()[0]}")
        if error is not None or (not matcher.accepting and not _any_text(matcher)):
            raise StructuredOutputError(f"the {what} matches no text at all")
        return Grammar(matcher, what)


def _any_text(matcher: GrammarMatcher) -> bool:
    """Does the matcher allow any token besides the end-of-generation ones?"""
    allowed = matcher.allowed().numpy()
    allowed[list(matcher.eos_ids)] = False
    return bool(allowed.any())


class Grammar:
    """A compiled, checked spec. Immutable; hands out fresh matchers."""

    def __init__(self, template: GrammarMatcher, kind: str) -> None:
        self._template = template  # initial state, mask already computed once
        self.kind = kind

    def matcher(self) -> GrammarMatcher:
        """A matcher at the start of the grammar, for one request."""
        return self._template.copy()


class GrammarMatcher:
    """One request's position in its grammar. Not thread-safe: owned by the engine thread."""

    def __init__(self, ll: llguidance.LLMatcher, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        self._ll = ll
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids  # every end-of-generation id: all allowed when the grammar may end
        self._mask: torch.Tensor | None = None  # packed mask of the current state, once computed
        # One flag per accepted token: did llguidance record it? (An EOS after the grammar has
        # already stopped is not recorded, so it must not be rolled back there.)
        self._recorded: list[bool] = []

    def copy(self) -> GrammarMatcher:
        out = GrammarMatcher(self._ll.deep_copy(), self.vocab_size, self.eos_ids)
        out._mask = self._mask
        out._recorded = list(self._recorded)
        return out

    def bitmask(self) -> torch.Tensor:
        """int32 [ceil(vocab_size / 32)]: bit t % 32 of word t // 32 set = token t allowed
        (llguidance's packed layout). Shared cache: do not modify it."""
        if self._mask is None:
            mask = torch.zeros((self.vocab_size + 31) // 32, dtype=torch.int32)
            self._ll.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
            self._mask = mask
        return self._mask

    def allowed(self) -> torch.Tensor:
        """bool [vocab_size]: True = the token may come next (EOS exactly when the grammar may
        end). A fresh tensor each call."""
        packed = self.bitmask().numpy().astype("<i4", copy=False).view(np.uint8)
        bits = np.unpackbits(packed, bitorder="little")[: self.vocab_size]
        return torch.from_numpy(bits.view(np.bool_))

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if it is not allowed here."""
        token_id = int(token_id)
        if not 0 <= token_id < self.vocab_size or self._ll.is_error():
            return False
        word = int(self.bitmask()[token_id >> 5])
        if not (word >> (token_id & 31)) & 1:
            return False
        stopped = self._ll.is_stopped()
        if not self._ll.consume_token(token_id):
            raise RuntimeError(f"llguidance refused an allowed token: {self._ll.get_error()}")
        self._mask = None
        self._recorded.append(not stopped)
        return True

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens (speculative decoding)."""
        if not 0 <= n <= len(self._recorded):
            raise ValueError(f"cannot roll back {n} tokens: {len(self._recorded)} are accepted")
        if n == 0:
            return
        undo = sum(self._recorded[-n:])
        del self._recorded[-n:]
        if undo and not self._ll.rollback(undo):
            raise RuntimeError(f"llguidance could not roll back: {self._ll.get_error()}")
        self._mask = None

    @property
    def accepting(self) -> bool:
        """The text so far is a complete match (EOS may come next)."""
        return self._ll.is_accepting()

    @property
    def is_terminated(self) -> bool:
        """The grammar has ended: EOS was accepted or nothing else can follow."""
        return self._ll.is_stopped()

    @property
    def error(self) -> str | None:
        """llguidance's error message if the matcher is in an error state."""
        if not self._ll.is_error():
            return None
        return self._ll.get_error() or "unknown llguidance error"
