"""The builtin JSON-schema-constrained decoder (hand-written), used for tool calls.

At each step :class:`JsonConstraint` returns the token ids that keep the output a
prefix of a JSON value matching a small subset of JSON Schema (objects with their
properties, strings, numbers, integers, booleans, null, enums, arrays). The
tokenizer's token strings and a character trie over them are computed once per
tokenizer (:func:`mindie_host.structured.vocab.vocab_for`), so one step walks only
the trie branches the grammar allows; inside a free string the allowed set is a
precomputed list.

Strings are generated without escapes (no ``"``, ``\\`` or control characters
inside) and at most ``maxLength`` (default 64) characters long; numbers have at
most 15 digits; arrays at most 8 items. This keeps every output valid JSON and
bounded in length (so even a random model ends its call), at the price of not
being able to produce every value. Full JSON Schema, regex and grammars go
through :mod:`mindie_host.structured.llg`.
"""

from __future__ import annotations

import bisect
import json
from typing import TYPE_CHECKING, Any

from .vocab import Vocab, is_safe_char, vocab_for

if TYPE_CHECKING:
    from ..host_protocol import Host

DEFAULT_MAX_STRING = 64
MAX_DIGITS = 15
MAX_ARRAY_ITEMS = 8

# -- the grammar --------------------------------------------------------------------------------
# A state is a tuple of pending elements; the first is being matched. Elements:
#   ("L", text)               the literal ``text`` must come next
#   ("W",)                    an optional single space
#   ("V", sid)                a value of schema ``sid`` (expanded when reached)
#   ("S", count, limit)       inside a string: safe characters until '"'
#   ("N", phase, digits, integer)  a number
#   ("E", literals, prefix)   one of the literal texts (enum, true/false)
#   ("P", choices, prefix)    one of several literal prefixes, each followed by its own schema
#   ("A", sid, count)         an array of schema ``sid`` after '[' (count items so far)
State = tuple


class Grammar:
    """A compiled JSON schema and its character-level step function."""

    def __init__(self, max_string: int = DEFAULT_MAX_STRING) -> None:
        self.schemas: list[tuple] = []
        self.max_string = max_string
        self._cache: dict[tuple[State, str], State | None] = {}

    # -- compiling ----------------------------------------------------------------------------
    def add(self, schema: Any) -> int:
        """Compile ``schema`` and return its id."""
        sid = len(self.schemas)
        self.schemas.append(("string", self.max_string))  # placeholder, replaced below
        self.schemas[sid] = self._compile(schema)
        return sid

    def _compile(self, schema: Any) -> tuple:
        if not isinstance(schema, dict):
            return ("string", self.max_string)
        if "const" in schema:
            return ("enum", (json.dumps(schema["const"], ensure_ascii=False),))
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return ("enum", tuple(dict.fromkeys(json.dumps(v, ensure_ascii=False) for v in schema["enum"])))
        kind = schema.get("type")
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), "string")
        if kind == "object" or (kind is None and isinstance(schema.get("properties"), dict)):
            props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
            required = [k for k in schema.get("required") or [] if k in props]
            keys = required or list(props)
            return ("object", tuple((k, self.add(props[k])) for k in keys))
        if kind == "array":
            return ("array", self.add(schema.get("items") or {"type": "string"}))
        if kind in ("integer", "number"):
            return (kind,)
        if kind == "boolean":
            return ("enum", ("true", "false"))
        if kind == "null":
            return ("enum", ("null",))
        limit = schema.get("maxLength")
        limit = limit if isinstance(limit, int) and 0 < limit < self.max_string else self.max_string
        return ("string", limit)

    def expand(self, sid: int) -> State:
        """The elements that produce one value of schema ``sid``."""
        s = self.schemas[sid]
        kind = s[0]
        if kind == "string":
            return (("L", '"'), ("S", 0, s[1]))
        if kind == "enum":
            return (("E", s[1], ""),)
        if kind in ("integer", "number"):
            return (("N", "start", 0, kind == "integer"),)
        if kind == "array":
            return (("L", "["), ("A", s[1], 0))
        if kind == "object":
            items: list[tuple] = []
            for i, (key, child) in enumerate(s[1]):
                lead = "{" if i == 0 else ","
                if i:
                    items.append(("L", lead))
                    items.append(("W",))
                    lead = ""
                items.append(("L", f"{lead}{json.dumps(key, ensure_ascii=False)}:"))
                items.append(("W",))
                items.append(("V", child))
            items.append(("L", "}") if s[1] else ("L", "{}"))
            return tuple(items)
        raise ValueError(kind)

    # -- stepping -------------------------------------------------------------------------------
    def _complete(self, el: tuple) -> State | None:
        """What replaces ``el`` when it ends here (``()`` to vanish), or ``None`` if it cannot end yet."""
        tag = el[0]
        if tag == "W":
            return ()
        if tag == "N":
            return () if el[1] in ("zero", "int", "frac") else None
        if tag == "E":
            return () if el[2] in el[1] else None
        if tag == "P":
            for lit, sid in el[1]:
                if el[2] == lit:
                    return (("V", sid),)
        return None

    def _step_el(self, el: tuple, ch: str) -> State | None:
        """Elements replacing ``el`` after it consumes ``ch``, or ``None``."""
        tag = el[0]
        if tag == "L":
            text = el[1]
            if ch != text[0]:
                return None
            return (("L", text[1:]),) if len(text) > 1 else ()
        if tag == "W":
            return () if ch == " " else None
        if tag == "S":
            if ch == '"':
                return ()
            if el[1] < el[2] and is_safe_char(ch):
                return (("S", el[1] + 1, el[2]),)
            return None
        if tag == "N":
            _, phase, digits, integer = el
            if phase == "start":
                if ch == "-":
                    return (("N", "neg", 0, integer),)
                phase = "neg"
            if phase == "neg":
                if ch == "0":
                    return (("N", "zero", 1, integer),)
                if "1" <= ch <= "9":
                    return (("N", "int", 1, integer),)
                return None
            if phase in ("zero", "int"):
                if phase == "int" and ch.isdigit() and ch.isascii() and digits < MAX_DIGITS:
                    return (("N", "int", digits + 1, integer),)
                if ch == "." and not integer:
                    return (("N", "dot", digits, integer),)
                return None
            if phase in ("dot", "frac"):
                if ch.isdigit() and ch.isascii() and digits < MAX_DIGITS:
                    return (("N", "frac", digits + 1, integer),)
                return None
            return None
        if tag == "E" or tag == "P":
            prefix = el[2] + ch
            lits = el[1] if tag == "E" else tuple(lit for lit, _ in el[1])
            if any(lit.startswith(prefix) for lit in lits):
                return ((tag, el[1], prefix),)
            return None
        if tag == "A":
            _, sid, count = el
            if ch == "]":
                return ()
            if count >= MAX_ARRAY_ITEMS:
                return None
            if count:
                return (("W",), ("V", sid), ("A", sid, count + 1)) if ch == "," else None
            return self._step((("V", sid), ("A", sid, 1)), ch)
        return None

    def _step(self, state: State, ch: str) -> State | None:
        while state:
            head, rest = state[0], state[1:]
            if head[0] == "V":
                state = self.expand(head[1]) + rest
                continue
            new = self._step_el(head, ch)
            if new is not None:
                return new + rest
            done = self._complete(head)
            if done is None:
                return None
            state = done + rest
        return None

    def step(self, state: State, ch: str) -> State | None:
        """The state after ``ch``, or ``None`` if ``ch`` is not allowed (memoized)."""
        key = (state, ch)
        hit = self._cache.get(key, key)
        if hit is not key:
            return hit  # type: ignore[return-value]
        if len(self._cache) > 200_000:
            self._cache.clear()
        out = self._cache[key] = self._step(state, ch)
        return out

    def feed(self, state: State, text: str) -> State | None:
        for ch in text:
            state = self.step(state, ch)
            if state is None:
                return None
        return state

    def finished(self, state: State) -> bool:
        """True when the value is complete and nothing more may follow."""
        return not state

    def can_end(self, state: State) -> bool:
        """True when the value may end here (a trailing number may still go on)."""
        while state:
            head = state[0]
            if head[0] == "V":
                return False
            done = self._complete(head)
            if done is None or done:
                return False
            state = state[1:]
        return True


def _in_string(state: State) -> tuple[int, int] | None:
    if state and state[0][0] == "S":
        return state[0][1], state[0][2]
    return None


class JsonConstraint:
    """``EngineRequest.logits_constraint`` for one request: output must be a JSON value of the schema.

    Called on the engine thread with the output token ids so far; returns the
    allowed next token ids (the end-of-sequence ids once the value is complete).
    """

    def __init__(self, vocab: Vocab, grammar: Grammar, root: State) -> None:
        self.vocab = vocab
        self.grammar = grammar
        self.state: State | None = root
        self.seen = 0
        self.text = ""

    @classmethod
    def for_schema(cls, host: Host, schema: dict[str, Any]) -> JsonConstraint:
        """Constrain the output to one JSON value of ``schema``."""
        g = Grammar()
        return cls(vocab_for(host), g, (("V", g.add(schema)),))

    @classmethod
    def for_tools(cls, host: Host, tools: list[dict[str, Any]]) -> JsonConstraint:
        """Constrain the output to ``{"name": <one of tools>, "arguments": {...its schema}}``."""
        g = Grammar()
        choices = []
        for tool in tools:
            fn = tool["function"]
            lit = '{"name": ' + json.dumps(fn["name"], ensure_ascii=False) + ', "arguments": '
            choices.append((lit, g.add(fn.get("parameters") or {"type": "object", "properties": {}})))
        return cls(vocab_for(host), g, (("P", tuple(choices), ""), ("L", "}")))

    def _advance(self, token_ids: list[int]) -> None:
        for tid in token_ids[self.seen:]:
            text = self.vocab.strings[tid] if 0 <= tid < len(self.vocab.strings) else None
            if self.state is None or text is None:
                self.state = None
                break
            self.state = self.grammar.feed(self.state, text)
            self.text += text
        self.seen = len(token_ids)

    def fork(self) -> JsonConstraint:
        """An independent copy at the same point (states are immutable: a shallow copy shares nothing mutable)."""
        twin = JsonConstraint(self.vocab, self.grammar, None)  # type: ignore[arg-type]
        twin.state, twin.seen, twin.text = self.state, self.seen, self.text
        return twin

    def __call__(self, output_token_ids: list[int]) -> list[int] | None:
        self._advance(output_token_ids)
        state = self.state
        if state is None:
            return None  # off the grammar (should not happen): stop constraining rather than fail
        if self.grammar.finished(state):
            return list(self.vocab.eos) or None
        allowed = self._allowed(state)
        if self.grammar.can_end(state):
            allowed.extend(self.vocab.eos)
        return allowed or None

    def _allowed(self, state: State) -> list[int]:
        g = self.grammar
        v = self.vocab
        inside = _in_string(state)
        if inside is not None:
            count, limit = inside
            room = limit - count
            end = bisect.bisect_right(v.safe_lens, room)
            out = v.safe_by_len[:end]
            for tid, q, s in v.quoted:
                if q <= room and g.feed(state, s) is not None:
                    out.append(tid)
            return out
        out = []
        stack = [(v.trie, state)]
        while stack:
            node, st = stack.pop()
            for ch, child in node[0].items():
                ns = g.step(st, ch)
                if ns is None:
                    continue
                out.extend(child[1])
                if child[0]:
                    stack.append((child, ns))
        return out


#: JSON Schema keywords :class:`Grammar` enforces fully (or that only annotate); a schema using any
#: other keyword (bounds, patterns, formats, anyOf, $ref, ...) goes to the llguidance engine instead.
SUBSET_KEYS = frozenset({"type", "properties", "required", "items", "enum", "const", "maxLength", "title",
                         "description", "default", "examples", "additionalProperties", "strict"})


def within_subset(schema: Any) -> bool:
    """Whether every part of ``schema`` is something :class:`Grammar` enforces (see :data:`SUBSET_KEYS`)."""
    if not isinstance(schema, dict) or set(schema) - SUBSET_KEYS:
        return False
    kind = schema.get("type")
    if isinstance(kind, list) or schema.get("additionalProperties") not in (None, False):
        return False
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, dict) or not all(within_subset(p) for p in props.values()):
            return False
        if set(props) - set(schema.get("required") or []) and schema.get("required"):
            return False  # optional properties next to required ones: Grammar would always leave them out
    items = schema.get("items")
    return items is None or within_subset(items)
