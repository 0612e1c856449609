"""Structured outputs on llguidance: JSON Schema, regex, a choice of strings, or a Lark/GBNF grammar.

:func:`compile_grammar` turns a :class:`~mindie_host.structured.spec.StructuredSpec` into
llguidance's grammar text and refuses (``RequestError``, 400) anything the library
reports as an error or as a schema feature it cannot enforce. :class:`GrammarConstraint`
is an ``EngineRequest.logits_constraint``: each step it feeds the new output tokens to
the matcher and returns the allowed next token ids (a row of the vocabulary mask).
The library's view of the tokenizer is built once per host (cached on ``host.caches``).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from ..engine.request import RequestError
from ..host_state import CacheSlot
from .spec import StructuredSpec

if TYPE_CHECKING:
    from ..host_protocol import Host

#: JSON is written with ``", "`` and ``": "`` separators and no other whitespace (as ``json.dumps``
#: writes it and models mostly read it), so a model cannot spend its token budget on blanks.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def host_eos(host: Host) -> list[int]:
    """The end-of-sequence ids the grammar may end with."""
    eos = list(host.info.eos_token_ids) if getattr(host, "info", None) is not None else []
    if not eos and host.tokenizer.eos_token_id is not None:
        eos = [host.tokenizer.eos_token_id]
    return eos


@dataclass
class Tokenizer:
    """llguidance's view of a tokenizer, and what rebuilds it in another process (``engineProcess``)."""

    native: llguidance.LLTokenizer
    spec: str  # the Hugging Face tokenizer.json text
    n_vocab: int
    eos: list[int]
    key: str = field(default="")

    @property
    def vocab_size(self) -> int:
        return self.native.vocab_size


#: tokenizers rebuilt in this process from a pickled constraint, by :attr:`Tokenizer.key`
_REBUILT: dict[str, Tokenizer] = {}


def make_tokenizer(tokenizer: Any, eos: list[int], vocab_size: int | None = None) -> Tokenizer:
    """llguidance's view of a Hugging Face fast tokenizer."""
    spec = tokenizer.backend_tokenizer.to_str()
    n_vocab = vocab_size or len(tokenizer)
    native = llguidance.LLTokenizer(spec, n_vocab=n_vocab, eos_token=eos or None)
    key = hashlib.sha256(spec.encode() + repr((n_vocab, eos)).encode()).hexdigest()
    return Tokenizer(native, spec, n_vocab, list(eos), key)


def _rebuilt(key: str, spec: str, n_vocab: int, eos: list[int]) -> Tokenizer:
    if key not in _REBUILT:
        _REBUILT[key] = Tokenizer(llguidance.LLTokenizer(spec, n_vocab=n_vocab, eos_token=eos or None),
                                  spec, n_vocab, eos, key)
    return _REBUILT[key]


#: llguidance's view of the tokenizer, per host
LLG_TOKENIZER: CacheSlot[Tokenizer] = CacheSlot("llguidance tokenizer")


def tokenizer_for(host: Host) -> Tokenizer:
    """The host's :func:`make_tokenizer`, built on first use (about a second) and cached."""
    def make() -> Tokenizer:
        size = max(len(host.tokenizer), getattr(host.info, "vocab_size", 0) or 0)
        return make_tokenizer(host.tokenizer, host_eos(host), size)

    return host.caches.get_or_make(LLG_TOKENIZER, make)


def compile_grammar(spec: StructuredSpec) -> str:
    """llguidance grammar text for ``spec``; a 400 naming ``spec.field`` if it cannot be enforced."""
    try:
        if spec.kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(spec.value, defaults=JSON_OPTIONS)
        elif spec.kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(spec.value)
        elif spec.kind == "choice":
            grammar = llguidance.grammar_from("choice", json.dumps(spec.value))
        else:
            grammar = llguidance.grammar_from("grammar", spec.value)
        is_error, problems = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise RequestError(f"{spec.field} cannot be compiled: {str(exc).splitlines()[0][:300]}",
                           field=spec.field, status=400) from None
    if is_error or problems:
        why = "; ".join(p.strip().splitlines()[0] for p in problems)[:500] or "invalid"
        raise RequestError(f"{spec.field} cannot be enforced: {why}", field=spec.field, status=400)
    return grammar


class GrammarConstraint:
    """``EngineRequest.logits_constraint`` that keeps one output inside a compiled grammar.

    Called on the engine thread with the output token ids so far; returns the allowed next
    token ids (the end-of-sequence ids once the grammar is complete). The output is cut at
    ``max_tokens`` like any other (``finish_reason: length``) if the grammar is not complete.
    """

    def __init__(self, tokenizer: Tokenizer, grammar: str) -> None:
        self.tokenizer = tokenizer
        self.grammar = grammar
        self.matcher = llguidance.LLMatcher(tokenizer.native, grammar)
        self.mask = llg_numpy.allocate_token_bitmask(1, tokenizer.vocab_size)
        self.seen = 0

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (``engineProcess``) before its first step. The tokenizer's JSON text (1.5 MB for the default
        model) is written once to a file of this process, and each constraint carries only the file's path and
        the tokenizer's key; the engine process reads the file once per key. Inline when no file can be written."""
        t = self.tokenizer
        path = _spec_file(t)
        if path is None:
            return (_unpickle, (t.key, t.spec, t.n_vocab, t.eos, self.grammar))
        return (_unpickle_from_file, (t.key, path, t.n_vocab, t.eos, self.grammar))

    @classmethod
    def for_spec(cls, host: Host, spec: StructuredSpec) -> GrammarConstraint:
        """A fresh constraint for one generated choice."""
        return cls(tokenizer_for(host), compile_grammar(spec))

    def fork(self) -> GrammarConstraint:
        """An independent copy at the same point of the grammar (the engine checks draft tokens on a fork)."""
        twin = object.__new__(GrammarConstraint)
        twin.tokenizer, twin.grammar, twin.seen = self.tokenizer, self.grammar, self.seen
        twin.matcher = self.matcher.deep_copy()
        twin.mask = llg_numpy.allocate_token_bitmask(1, self.tokenizer.vocab_size)
        return twin

    def __call__(self, output_token_ids: list[int]) -> np.ndarray | None:
        m = self.matcher
        for tid in output_token_ids[self.seen:]:
            m.consume_token(tid)
        self.seen = len(output_token_ids)
        if m.is_error():
            return None  # off the grammar (should not happen): stop constraining rather than fail
        llg_numpy.fill_next_token_bitmask(m, self.mask, 0)
        bits = np.unpackbits(self.mask[0].view(np.uint8), bitorder="little")[: self.tokenizer.vocab_size]
        allowed = np.flatnonzero(bits)
        return allowed if allowed.size else None


def bounded(schema: Any, limit: int) -> Any:
    """A copy of ``schema`` that a model always finishes, as the builtin decoder bounds tool-call arguments.

    Every free string (no maxLength, enum, const, pattern or format) is at most ``limit`` characters, and an
    object with ``properties`` that does not say otherwise takes no other keys (``additionalProperties:
    false``), so no free-form key can run on. Used for tool-call arguments only, never for response_format.
    """
    if isinstance(schema, list):
        return [bounded(s, limit) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in ("enum", "const", "default", "examples") else bounded(v, limit)) for k, v in schema.items()}
    kind = out.get("type")
    is_string = kind == "string" or (isinstance(kind, list) and "string" in kind)
    if is_string and not {"maxLength", "enum", "const", "pattern", "format"} & set(out):
        out["maxLength"] = limit
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _unpickle(key: str, spec: str, n_vocab: int, eos: list[int], grammar: str) -> GrammarConstraint:
    return GrammarConstraint(_rebuilt(key, spec, n_vocab, eos), grammar)


#: tokenizer key -> the file holding its JSON text, written by this process (removed at exit)
_SPEC_FILES: dict[str, str] = {}


def _spec_file(t: Tokenizer) -> str | None:
    path = _SPEC_FILES.get(t.key)
    if path is None:
        try:
            fd, path = tempfile.mkstemp(prefix=f"mindie-llg-{t.key[:16]}-", suffix=".json")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(t.spec)
        except OSError:
            return None
        _SPEC_FILES[t.key] = path
        atexit.register(_remove, path)
    return path


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _unpickle_from_file(key: str, path: str, n_vocab: int, eos: list[int], grammar: str) -> GrammarConstraint:
    if key not in _REBUILT:
        with open(path, encoding="utf-8") as f:
            _rebuilt(key, f.read(), n_vocab, eos)
    return GrammarConstraint(_REBUILT[key], grammar)
