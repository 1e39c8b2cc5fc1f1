"""Structured output: constrain what a generation may sample to a JSON schema, a regular expression or a grammar.

Three small pieces, on llguidance (the constrained-decoding engine llama.cpp, vLLM and SGLang use; an optional
dependency, ``pip install 'kvtrace[grammar]'``):

- ``Constraint``: what the output must match (frozen; no tokenizer yet). ``Constraint.json_schema(schema)``,
  ``.json_object()``, ``.regex(pattern)``, ``.lark(grammar)`` (llguidance's Lark variant).
- ``Grammar``: a constraint compiled for one tokenizer and its stop ids, checked once (a bad schema or pattern
  is a ``UsageError`` here, before any token); ``artifact.grammar(constraint)`` binds the artifact's.
  Also ``Constraint.choice([...])`` (one of some strings) and ``.gbnf(grammar)`` (llama.cpp's grammars).
- ``GrammarState``: one generation's progress through it, made by ``Grammar.start()``. Before each sample,
  ``mask(logits)`` sets every token the constraint does not allow next to -inf (logits [1, V]); after it,
  ``advance(token)`` records the token — sampling does both (``generate.sample``), the one place it advances.
  ``done`` once the constraint is complete and allows nothing more (the generation then ends: stop reason
  "grammar"). A stop id is allowed exactly where the constraint may end.

The mask runs on the host, ~0.05-1 ms per token for a JSON schema over a 49k vocabulary (llguidance computes it
lazily from the parser's state; no precomputed automaton, so a new schema costs ~1 ms to compile).
"""

from __future__ import annotations

import enum
import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtrace._errors import UnsupportedError, UsageError

__all__ = ["Constraint", "ConstraintKind", "Grammar", "GrammarState", "checked_grammar", "warm"]

INSTALL = "pip install 'kvtrace[grammar]' (llguidance)"
# JSON whitespace between tokens: a line break and up to 32 spaces or tabs of indentation, or up to 2 spaces; bounded
# because a small model left free whitespace can loop on it forever (seen in tests: "3\n\n\n..." to the token limit).
# A schema's own "x-guidance" options override this.
JSON_DEFAULTS = {"whitespace_pattern": r"(?:\r?\n[ \t]{0,32}|[ \t]{0,2})"}
_SHIFTS = torch.arange(32, dtype=torch.int32)  # bit b of a mask word: token 32 w + b


class ConstraintKind(enum.StrEnum):
    JSON_SCHEMA = "json_schema"  # text: the schema, as JSON
    JSON_OBJECT = "json_object"  # any JSON object (OpenAI's response_format json_object)
    REGEX = "regex"  # text: the pattern the whole output matches
    LARK = "lark"  # text: a grammar in llguidance's Lark variant (start rule ``start``)


@dataclass(frozen=True)
class Constraint:
    """What a generation's output must match. ``text``: the schema (JSON text), pattern or grammar, as given.

    JSON schemas follow llguidance's coverage (most of draft 2020-12; ``x-guidance`` in the schema sets its
    options, e.g. ``{"whitespace_flexible": false}`` for compact JSON); by default a line break with indentation,
    or a space or two, may stand between tokens, as in JSON text models were trained on (``JSON_DEFAULTS``:
    bounded, so no model can loop on whitespace)."""

    kind: ConstraintKind
    text: str = ""

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str) -> Constraint:
        """A JSON value valid under ``schema`` (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                parsed = json.loads(schema)
            except json.JSONDecodeError as e:
                raise UsageError(f"the JSON schema is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                                 "give a schema object, e.g. {\"type\": \"object\"}") from None
        else:
            parsed = schema
        if parsed is True:  # the schema every value is valid under
            parsed = {}
        if parsed is False:
            raise UsageError("the JSON schema is false, which no value is valid under; give a schema object")
        if not isinstance(parsed, Mapping):
            raise UsageError(f"a JSON schema is an object (or true); got {type(parsed).__name__}")
        return cls(ConstraintKind.JSON_SCHEMA, json.dumps(parsed))  # key order kept: properties come in it

    @classmethod
    def json_object(cls) -> Constraint:
        """Any JSON object."""
        return cls(ConstraintKind.JSON_OBJECT)

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        """Output matching ``pattern`` as a whole (Rust regex syntax: no look-around or back-references)."""
        if not isinstance(pattern, str) or not pattern:
            raise UsageError("the regular expression is empty; give a pattern the whole output must match")
        return cls(ConstraintKind.REGEX, pattern)

    @classmethod
    def lark(cls, grammar: str) -> Constraint:
        """Output derived from the rule ``start`` of ``grammar`` (llguidance's Lark variant; ``%json {...}``
        embeds a JSON schema)."""
        if not isinstance(grammar, str) or not grammar.strip():
            raise UsageError("the grammar is empty; give a Lark grammar with a `start` rule")
        return cls(ConstraintKind.LARK, grammar)

    @classmethod
    def choice(cls, options: Sequence[str]) -> Constraint:
        """Exactly one of ``options`` (e.g. the labels of a classification), as written."""
        if isinstance(options, str) or not isinstance(options, Sequence) or not options:
            raise UsageError(f"a choice needs a list of strings, the output being one of them; got {options!r}")
        if not all(isinstance(o, str) and o for o in options):
            raise UsageError(f"every choice must be a non-empty string; got {list(options)!r}")
        # Lark string literals, escaped as JSON strings are ("\"", "\\", "\n", ...)
        return cls(ConstraintKind.LARK, "start: " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options))

    @classmethod
    def gbnf(cls, grammar: str) -> Constraint:
        """Output derived from the rule ``root`` of ``grammar`` in llama.cpp's GBNF, translated to llguidance's Lark
        variant (its own translator)."""
        if not isinstance(grammar, str) or not grammar.strip():
            raise UsageError("the GBNF grammar is empty; give one with a `root` rule")
        _llguidance()
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            return cls(ConstraintKind.LARK, gbnf_to_lark(grammar))
        except Exception as e:  # its translator raises plain Exceptions and GbnfToLarkError
            raise UsageError(f"invalid GBNF grammar: {_first_line(str(e))}") from None

    def check(self) -> Constraint:
        """This constraint once llguidance accepts it (a UsageError naming what is wrong otherwise); no tokenizer
        needed, so a command can refuse a bad pattern before it loads or compiles anything."""
        _validated(self, self._llg_grammar(), None)
        return self

    def describe(self) -> str:
        """One line for messages and stats: the kind and the start of the text."""
        text = self.text if len(self.text) <= 60 else self.text[:57] + "..."
        return str(self.kind) if not text else f"{self.kind} {text}"

    def _llg_grammar(self) -> str:
        llg = _llguidance()
        if self.kind is ConstraintKind.JSON_SCHEMA:
            options = json.loads(self.text).get("x-guidance")
            own = isinstance(options, dict) and ({"whitespace_pattern", "whitespace_flexible"} & set(options))
            try:  # the schema's own whitespace options, where it has any, else the bounded default
                return llg.LLMatcher.grammar_from_json_schema(self.text, defaults=None if own else JSON_DEFAULTS)
            except ValueError as e:  # e.g. x-guidance options that are not an object
                raise UsageError(f"invalid json schema: {_first_line(str(e))}") from None
        if self.kind is ConstraintKind.JSON_OBJECT:
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
        if self.kind is ConstraintKind.REGEX:
            return llg.LLMatcher.grammar_from_regex(self.text)
        return llg.LLMatcher.grammar_from_lark(self.text)


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise UnsupportedError(f"structured output (a JSON schema, regex or grammar) needs llguidance: {INSTALL}"
                               ) from None
    return llguidance


@functools.lru_cache(maxsize=4)
def _lltokenizer(tokenizer_json: str, eos_ids: tuple[int, ...]) -> Any:
    """llguidance's view of a tokenizer (its tokens as bytes; ~0.3 s for a 49k vocabulary, so kept), or the
    UnsupportedError it could not be built with (kept too: a server would otherwise pay for it every request)."""
    llg = _llguidance()
    try:
        return llg.LLTokenizer(tokenizer_json, eos_token=list(eos_ids) or None)
    except Exception as e:  # a tokenizer llguidance cannot read (e.g. a WordLevel one without byte fallback)
        return UnsupportedError(f"llguidance cannot use this tokenizer for structured output ({_first_line(str(e))});"
                                " it needs a byte-level BPE or SentencePiece tokenizer")


def warm(tokenizer: Any, eos_ids: Sequence[int] = ()) -> None:
    """Build (and keep) llguidance's view of ``tokenizer`` now, e.g. in a thread while a server starts, so the
    first request with a constraint does not wait ~0.3 s for it; silent where llguidance is missing."""
    try:
        _lltokenizer(tokenizer if isinstance(tokenizer, str) else tokenizer.to_str(), tuple(int(i) for i in eos_ids))
    except UnsupportedError:
        pass


class Grammar:
    """A ``Constraint`` compiled for one tokenizer and its stop ids, checked; ``start()`` one state per generation.

    ``tokenizer``: a ``tokenizers.Tokenizer`` or its JSON text; ``eos_ids``: the generation's stop ids (allowed
    where the constraint may end; none: the output ends only when the constraint allows nothing more, or at
    the token limit)."""

    def __init__(self, constraint: Constraint, tokenizer: Any, eos_ids: Sequence[int] = ()):
        if not isinstance(constraint, Constraint):
            raise UsageError(f"expected a kvtrace.Constraint, got {type(constraint).__name__}; build one with "
                             "Constraint.json_schema(...), .json_object(), .regex(...) or .lark(...)")
        text = tokenizer if isinstance(tokenizer, str) else tokenizer.to_str()
        self.constraint = constraint
        self.eos_ids = tuple(int(i) for i in eos_ids)
        self._tok = _lltokenizer(text, self.eos_ids)
        if isinstance(self._tok, UnsupportedError):
            raise self._tok
        self._grammar = _validated(constraint, constraint._llg_grammar(), self._tok)
        self.vocab_size = self._tok.vocab_size  # tokens the mask covers (logits past it are never allowed)
        # with no stop ids llguidance still names an end-of-text token of its own: never allowed here
        self._foreign_eos = () if self.eos_ids else tuple(self._tok.eos_tokens)

    def start(self) -> GrammarState:
        """A fresh state at the start of the output."""
        llg = _llguidance()
        return GrammarState(self, llg.LLMatcher(self._tok, self._grammar, log_level=0))

    def __repr__(self) -> str:
        return f"Grammar({self.constraint.describe()!r})"


def checked_grammar(grammar: Grammar | None, eos_ids: Sequence[int]) -> Grammar | None:
    """``grammar`` (or None) once it is a Grammar whose stop ids are among ``eos_ids``, the ids the generation or
    request stops at (a stop id the grammar allows but the caller would not stop at would end up in the text)."""
    if grammar is None:
        return None
    if not isinstance(grammar, Grammar):
        raise UsageError(f"grammar= takes a kvtrace.Grammar (a Constraint bound to the tokenizer: "
                         f"artifact.grammar(constraint)), got {type(grammar).__name__}")
    extra = sorted(set(grammar.eos_ids) - {int(i) for i in eos_ids})
    if extra:
        raise UsageError(f"the grammar lets the output end with stop ids {extra}, which this generation does not "
                         f"stop at (its eos_ids: {sorted(int(i) for i in eos_ids)}); bind the grammar with the "
                         "generation's own stop ids")
    return grammar


def _validated(constraint: Constraint, grammar: str, tokenizer: Any) -> str:
    """``grammar`` (llguidance's form of ``constraint``) once llguidance accepts it, with ``tokenizer`` or None."""
    bad, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if bad:
        raise UsageError(f"invalid {constraint.kind.replace('_', ' ')}: {_first_line(messages[0])}")
    return grammar


def _first_line(text: str) -> str:
    """llguidance's message in one line: its first, plus the "error: ..." of a multi-line regex report."""
    lines = text.strip().splitlines() or ["rejected"]
    why = [ln.strip()[len("error:"):].strip() for ln in lines[1:] if ln.strip().startswith("error:")]
    line = " ".join([lines[0].rstrip(":") + (":" if why else ""), *why])
    return line if len(line) <= 300 else line[:297] + "..."


class GrammarState:
    """One generation's position in a ``Grammar``: ``mask`` before a sample, ``advance`` after it."""

    def __init__(self, grammar: Grammar, matcher: Any):
        self.grammar, self._m = grammar, matcher
        words = (grammar.vocab_size + 31) // 32
        self._bits = torch.zeros(words, dtype=torch.int32)  # [W]: bit b of word w = token 32 w + b allowed
        self.tokens = 0  # tokens advanced so far

    @property
    def done(self) -> bool:
        """The constraint is complete and allows no further token (only a stop id)."""
        self._check()
        return bool(self._m.is_stopped())

    @property
    def accepting(self) -> bool:
        """The output so far is complete under the constraint (it may still go on)."""
        return bool(self._m.is_accepting())

    def forced(self) -> list[int]:
        """The tokens the constraint forces next, in the tokenizer's own spelling (e.g. '"company": "' after '{'
        in a schema's object): likely drafts for speculative decoding, not certain ones (the model may spell
        the same bytes with other tokens, which the mask allows too)."""
        tokens = list(self._m.compute_ff_tokens())
        self._check()
        return tokens

    def allowed(self, vocab: int) -> torch.Tensor:
        """[vocab] bool: the tokens the constraint allows next."""
        self._m.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        self._check()
        bits = ((self._bits[:, None] >> _SHIFTS) & 1).reshape(-1).bool()  # [W * 32]
        if self.grammar._foreign_eos:
            bits[list(self.grammar._foreign_eos)] = False
        if bits.numel() >= vocab:
            return bits[:vocab]
        return torch.cat([bits, bits.new_zeros(vocab - bits.numel())])

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> float32 logits [B, V] with every token the constraint forbids next at -inf."""
        ok = self.allowed(logits.shape[-1]).to(logits.device)
        if not bool(ok.any()):
            raise UsageError(f"the {self.grammar.constraint.kind.replace('_', ' ')} allows no token after "
                             f"{self.tokens} generated (none of the model's {logits.shape[-1]} tokens continues it); "
                             "check the constraint against the tokenizer")
        return logits.float().masked_fill(~ok, float("-inf"))

    def advance(self, token: int) -> None:
        """Record the sampled ``token`` (one the last ``mask`` allowed)."""
        if not self._m.consume_token(int(token)):
            self._check()
            raise UsageError(f"token {int(token)} is not allowed here by the constraint")  # a caller bypassed mask
        self.tokens += 1

    def _check(self) -> None:
        if self._m.is_error():
            raise UsageError(f"the constraint failed: {_first_line(self._m.get_error())}")
