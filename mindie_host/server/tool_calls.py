"""Function calling: tool-call parsers per model family and JSON-schema-constrained decoding.

Two pieces, both used by the OpenAI chat endpoint:

* **Parsers** turn generated text into OpenAI ``tool_calls``. The parser is
  chosen by model family through the firstresult hook
  ``mindie_host_tool_call_parser(model_type, host)``; the builtins here answer
  last (``trylast``), so any plugin wins. :class:`HermesToolParser` reads
  ``<tool_call>{json}</tool_call>`` blocks (Qwen, Hermes), :class:`JsonToolParser`
  reads a bare JSON object or list (Llama, SmolLM).
* **Constrained decoding** (:class:`JsonConstraint`) makes a named
  ``tool_choice`` (and ``required``) produce a valid call: at each step it
  returns the token ids that keep the output a prefix of a JSON value matching
  a small subset of JSON Schema (objects with their properties, strings,
  numbers, integers, booleans, null, enums, arrays). The tokenizer's token
  strings and a character trie over them are computed once per tokenizer
  (cached on ``host.state``), so one step walks only the trie branches the
  grammar allows; inside a free string the allowed set is a precomputed list.

Strings are generated without escapes (no ``"``, ``\\`` or control characters
inside) and at most ``maxLength`` (default 64) characters long; numbers have at
most 15 digits; arrays at most 8 items. This keeps every output valid JSON and
bounded in length, at the price of not being able to produce every value.
"""

from __future__ import annotations

import abc
import bisect
import json
import re
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import hookimpl
from ..engine.request import RequestError

if TYPE_CHECKING:
    from ..host import Host

STATE_KEY = "tool_calls.vocab"
DEFAULT_MAX_STRING = 64
MAX_DIGITS = 15
MAX_ARRAY_ITEMS = 8
HERMES_FAMILIES = ("qwen", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "hermes", "mistral")


def new_call_id() -> str:
    """An OpenAI-style tool call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


def make_call(name: str, arguments: Any) -> dict[str, Any]:
    """One OpenAI ``tool_calls`` entry; ``arguments`` is encoded as a JSON string if it is not one."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments if arguments is not None else {},
                                                                   ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def _call_from_obj(obj: Any) -> dict[str, Any] | None:
    if not isinstance(obj, dict):
        return None
    fn = obj.get("function") if isinstance(obj.get("function"), dict) else obj
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        return None
    args = fn.get("arguments", fn.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return make_call(name, args)


def _json_values(text: str) -> list[Any]:
    """Every top-level JSON object or array that appears in ``text``, in order."""
    decoder = json.JSONDecoder()
    out = []
    i = 0
    while i < len(text):
        j = min((k for k in (text.find("{", i), text.find("[", i)) if k >= 0), default=-1)
        if j < 0:
            break
        try:
            value, end = decoder.raw_decode(text, j)
        except ValueError:
            i = j + 1
            continue
        out.append(value)
        i = end
    return out


class ToolParser(abc.ABC):
    """Base tool-call parser: subclasses set the text format a model family uses.

    ``parse(text)`` returns OpenAI ``tool_calls`` or ``None``; ``content(text)``
    is the text left once the calls are removed; ``might_be_call(prefix)`` tells
    a stream whether to hold text back; ``instructions(tools)`` is the system
    prompt used when the model's chat template does not render ``tools``;
    ``render(calls)`` writes past calls back as assistant text.
    """

    name = "base"

    @abc.abstractmethod
    def parse(self, text: str) -> list[dict[str, Any]] | None:
        """The OpenAI ``tool_calls`` found in ``text``, or None."""

    def content(self, text: str) -> str:
        return ""

    @abc.abstractmethod
    def might_be_call(self, prefix: str) -> bool:
        """Whether streamed text starting with ``prefix`` could still turn into a call."""

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        specs = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
        return (
            "You can call functions. The available functions are:\n" + specs + "\n"
            "To call a function, answer only with " + self.example() + ". Otherwise answer normally."
        )

    def example(self) -> str:
        return '{"name": <function name>, "arguments": <JSON object of arguments>}'

    def render(self, calls: list[dict[str, Any]]) -> str:
        parts = []
        for call in calls:
            fn = call.get("function", {})
            try:
                args = json.loads(fn.get("arguments") or "{}")
            except ValueError:
                args = fn.get("arguments")
            parts.append(json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False))
        return "\n".join(parts)


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen2/3, Hermes)."""

    name = "hermes"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> list[dict[str, Any]] | None:
        if "<tool_call>" not in text:
            return None
        calls = []
        for body in self._block.findall(text):
            for value in _json_values(body):
                call = _call_from_obj(value)
                if call is not None:
                    calls.append(call)
        return calls or None

    def content(self, text: str) -> str:
        return text.split("<tool_call>", 1)[0].strip()

    def might_be_call(self, prefix: str) -> bool:
        stripped = prefix.lstrip()
        return "<tool_call>".startswith(stripped) or stripped.startswith("<tool_call>")

    def example(self) -> str:
        return '<tool_call>{"name": <function name>, "arguments": <JSON object of arguments>}</tool_call>'

    def render(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(f"<tool_call>{line}</tool_call>" for line in super().render(calls).splitlines())


class JsonToolParser(ToolParser):
    """A bare JSON call, a list of calls, or either in a Markdown code fence (Llama 3, SmolLM)."""

    name = "json"
    _fence = re.compile(r"^```(?:json)?\s*(.*?)\s*(?:```)?\s*$", re.DOTALL)

    def _body(self, text: str) -> str:
        s = text.strip()
        m = self._fence.match(s)
        return m.group(1) if m else s

    def parse(self, text: str) -> list[dict[str, Any]] | None:
        body = self._body(text)
        if not body.startswith(("{", "[")):
            return None
        calls = []
        for value in _json_values(body):
            items = value if isinstance(value, list) else [value]
            for item in items:
                call = _call_from_obj(item)
                if call is None:
                    return None
                calls.append(call)
        return calls or None

    def might_be_call(self, prefix: str) -> bool:
        s = prefix.lstrip()
        return not s or s.startswith(("{", "[")) or "```".startswith(s[:3]) or s.startswith("```")


class ParserAdapter(JsonToolParser):
    """Wraps a plugin's parser that only has ``parse(text)``; the rest comes from :class:`JsonToolParser`."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = getattr(inner, "name", type(inner).__name__)

    def parse(self, text: str) -> list[dict[str, Any]] | None:
        return self.inner.parse(text)

    def content(self, text: str) -> str:
        return self.inner.content(text) if hasattr(self.inner, "content") else ""

    def might_be_call(self, prefix: str) -> bool:
        return self.inner.might_be_call(prefix) if hasattr(self.inner, "might_be_call") else True


def builtin_parser(model_type: str) -> ToolParser:
    """The builtin parser for a model family."""
    family = (model_type or "").lower()
    if family.startswith(HERMES_FAMILIES):
        return HermesToolParser()
    return JsonToolParser()


@hookimpl(trylast=True)
def mindie_host_tool_call_parser(model_type: str, host: Host) -> ToolParser:
    return builtin_parser(model_type)


# =============================================================================================
# JSON-schema-constrained decoding
# =============================================================================================
@dataclass
class Vocab:
    """Token strings of one tokenizer, and a character trie over them (built once)."""

    strings: list[str | None]
    trie: list[Any]  # node = [children: dict[str, node], token ids ending here]
    safe_by_len: list[int]  # ids whose text may appear inside a JSON string, shortest first
    safe_lens: list[int]  # the length of each id in safe_by_len
    quoted: list[tuple[int, int, str]]  # (id, index of first '"', text) where the text before the quote is safe
    eos: list[int]


def _is_safe_char(c: str) -> bool:
    return c != '"' and c != "\\" and c >= " " and c != "\x7f"


def _byte_decoder() -> dict[str, int]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_strings(tokenizer: Any) -> list[str | None]:
    """The exact text each token id adds to an output (``None``: special, or not whole UTF-8)."""
    size = len(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special |= {i for i, t in added.items() if getattr(t, "special", False)}
    byte_level = any(p and "Ġ" in p for p in pieces[:5000] if p)
    decoder = _byte_decoder() if byte_level else {}
    out: list[str | None] = []
    for tid, piece in enumerate(pieces):
        if piece is None or tid in special:
            out.append(None)
            continue
        if byte_level:
            try:
                text = bytes(decoder[c] for c in piece).decode("utf-8")
            except (KeyError, UnicodeDecodeError):
                text = None
        elif piece.startswith("<0x") and piece.endswith(">"):
            text = None  # a sentencepiece byte-fallback piece: part of a multi-byte character
        else:
            text = piece.replace("▁", " ")
        out.append(text or None)
    return out


def build_vocab(tokenizer: Any, eos: list[int]) -> Vocab:
    """Precompute what :class:`JsonConstraint` needs for one tokenizer."""
    strings = token_strings(tokenizer)
    root: list[Any] = [{}, []]
    safe: list[tuple[int, int]] = []
    quoted: list[tuple[int, int, str]] = []
    for tid, s in enumerate(strings):
        if not s:
            continue
        node = root
        for c in s:
            nxt = node[0].get(c)
            if nxt is None:
                nxt = node[0][c] = [{}, []]
            node = nxt
        node[1].append(tid)
        q = s.find('"')
        if q < 0:
            if all(_is_safe_char(c) for c in s):
                safe.append((len(s), tid))
        elif all(_is_safe_char(c) for c in s[:q]):
            quoted.append((tid, q, s))
    safe.sort()
    return Vocab(strings, root, [t for _, t in safe], [n for n, _ in safe], quoted, list(eos))


def vocab_for(host: Host) -> Vocab:
    """The :class:`Vocab` of the host's tokenizer, built on first use and cached on ``host.state``."""
    cached = host.state.get(STATE_KEY)
    if cached is None:
        eos = list(host.info.eos_token_ids) if host.info is not None else []
        if not eos and host.tokenizer.eos_token_id is not None:
            eos = [host.tokenizer.eos_token_id]
        cached = host.state[STATE_KEY] = build_vocab(host.tokenizer, eos)
    return cached


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
            if el[1] < el[2] and _is_safe_char(ch):
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


# =============================================================================================
# the chat endpoint's side: validating tools/tool_choice, prompting, and reading the answer
# =============================================================================================
TOOL_CHOICES = ("none", "auto", "required")


def validate_tools(tools: Any) -> list[dict[str, Any]]:
    """``tools`` (spec §4.2.3): a list of ``{"type": "function", "function": {name, description, parameters, strict}}``."""
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of tool objects", field="tools")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise RequestError(f"{where} must be an object", field=where)
        if tool.get("type") != "function":
            raise RequestError(f"{where}.type must be 'function', got {tool.get('type')!r}", field=f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise RequestError(f"{where}.function must be an object", field=f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"{where}.function.name must be a non-empty string", field=f"{where}.function.name")
        if name in names:
            raise RequestError(f"{where}.function.name {name!r} is not unique", field=f"{where}.function.name")
        names.add(name)
        for key, kind in (("description", str), ("strict", bool)):
            if fn.get(key) is not None and not isinstance(fn[key], kind):
                raise RequestError(f"{where}.function.{key} must be a {kind.__name__}", field=f"{where}.function.{key}")
        params = fn.get("parameters")
        if params is None:
            continue
        pw = f"{where}.function.parameters"
        if not isinstance(params, dict):
            raise RequestError(f"{pw} must be a JSON Schema object", field=pw)
        if params.get("type", "object") != "object":
            raise RequestError(f"{pw}.type must be 'object', got {params.get('type')!r}", field=f"{pw}.type")
        props = params.get("properties", {})
        if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
            raise RequestError(f"{pw}.properties must be an object of schemas", field=f"{pw}.properties")
        required = params.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise RequestError(f"{pw}.required must be a list of strings", field=f"{pw}.required")
        missing = [r for r in required if r not in props]
        if missing:
            raise RequestError(f"{pw}.required names unknown properties {missing}", field=f"{pw}.required")
        extra = params.get("additionalProperties")
        if extra is not None and not isinstance(extra, (bool, dict)):
            raise RequestError(f"{pw}.additionalProperties must be a boolean", field=f"{pw}.additionalProperties")
    return tools


@dataclass
class ToolPlan:
    """What a chat request asked of its tools, and how to turn the output into ``tool_calls``.

    ``mode`` is ``none``, ``auto``, ``required`` or ``named`` (``function`` names the tool).
    """

    mode: str
    tools: list[dict[str, Any]]
    parser: ToolParser
    function: str | None = None

    @property
    def active(self) -> bool:
        return self.mode != "none" and bool(self.tools)

    @property
    def constrained(self) -> bool:
        return self.mode in ("named", "required")

    def offered(self) -> list[dict[str, Any]]:
        """The tools the model is told about."""
        if self.mode == "named":
            return [t for t in self.tools if t["function"]["name"] == self.function]
        return self.tools if self.active else []

    def prepare(self, messages: list[dict[str, Any]], template: str) -> tuple[list[dict[str, Any]], Any]:
        """Messages and ``tools`` for the chat template.

        A template that renders ``tools`` / ``tool_calls`` itself gets them; for one that
        does not (SmolLM2's), the tools go into the system prompt and past calls into the
        assistant text, in the parser's format, so the model sees both.
        """
        offered = self.offered()
        knows_tools = "tools" in template
        knows_calls = "tool_calls" in template
        out = []
        for msg in messages:
            if msg.get("tool_calls") and not knows_calls:
                text = self.parser.render(msg["tool_calls"])
                msg = {**msg, "content": (msg.get("content") + "\n" if msg.get("content") else "") + text}
                msg.pop("tool_calls")
            out.append(msg)
        if offered and not knows_tools:
            note = self.parser.instructions(offered)
            if self.mode == "named":
                note += f"\nCall the function {self.function} now."
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + note}
            else:
                out.insert(0, {"role": "system", "content": note})
            return out, None
        return out, (offered or None)

    def constraint(self, host: Host) -> JsonConstraint | None:
        """A fresh logits constraint for one generated choice (``None`` when unconstrained)."""
        if self.mode == "named":
            fn = self.offered()[0]["function"]
            return JsonConstraint.for_schema(host, fn.get("parameters") or {"type": "object", "properties": {}})
        if self.mode == "required":
            return JsonConstraint.for_tools(host, self.tools)
        return None

    def finish(self, text: str, finish_reason: str) -> tuple[str, list[dict[str, Any]] | None, str]:
        """``(content, tool_calls, finish_reason)`` for a complete output."""
        if not self.active:
            return text, None, finish_reason
        calls: list[dict[str, Any]] | None = None
        if self.mode == "named":
            try:
                args = json.loads(text)
            except ValueError:
                args = None
            if isinstance(args, dict):
                calls = [make_call(self.function or "", text)]
        elif self.mode == "required":
            try:
                obj = json.loads(text)
            except ValueError:
                obj = None
            call = _call_from_obj(obj)
            calls = [call] if call else None
        else:
            calls = self.parser.parse(text)
        if not calls:
            return text, None, finish_reason
        content = self.parser.content(text) if self.mode == "auto" else ""
        return content, calls, "tool_calls"


def plan_tools(host: Host, tools_raw: Any, choice: Any) -> ToolPlan:
    """Validate ``tools`` and ``tool_choice`` and pick the model family's parser."""
    tools = validate_tools(tools_raw) if tools_raw is not None else []
    parser = host.state.get("tool_calls.parser")
    if parser is None:
        model_type = host.info.model_type if host.info is not None else "llama"
        parser = host.plugins.hook.mindie_host_tool_call_parser(model_type=model_type, host=host)
        if parser is None:
            parser = builtin_parser(model_type)
        elif not isinstance(parser, ToolParser):
            parser = ParserAdapter(parser)
        host.state["tool_calls.parser"] = parser
    if choice is None:
        return ToolPlan("auto" if tools else "none", tools, parser)
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise RequestError(f"tool_choice must be one of {list(TOOL_CHOICES)} or a function object, got {choice!r}",
                               field="tool_choice")
        if choice == "required" and not tools:
            raise RequestError("tool_choice 'required' needs a non-empty tools list", field="tool_choice")
        return ToolPlan(choice, tools, parser)
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError('tool_choice object must be {"type": "function", "function": {"name": ...}}',
                               field="tool_choice")
        name = fn["name"]
        if name not in {t["function"]["name"] for t in tools}:
            raise RequestError(f"tool_choice.function.name {name!r} is not one of the tools",
                               field="tool_choice.function.name")
        return ToolPlan("named", tools, parser, name)
    raise RequestError("tool_choice must be a string or an object", field="tool_choice")


class ToolStream:
    """Turns one choice's streamed text into chat-chunk deltas, with ``tool_calls`` where there are calls.

    Named tool choice streams the arguments as they are generated. Otherwise
    text that may be the start of a call is held back until it is clear; at the
    end, held text becomes ``tool_calls`` (parsed) or content.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.held = ""
        self.streaming = not plan.active  # plain content from here on
        self.call_id = new_call_id()
        self.started = False

    def feed(self, new_text: str) -> list[dict[str, Any]]:
        """Deltas for ``new_text`` (not the last piece)."""
        if self.streaming:
            return [{"content": new_text}] if new_text else []
        if self.plan.mode == "named":
            if not new_text:
                return []
            return [{"tool_calls": [self._call_delta(new_text)]}]
        self.held += new_text
        if self.plan.mode == "auto" and not self.plan.parser.might_be_call(self.held):
            self.streaming = True
            text, self.held = self.held, ""
            return [{"content": text}]
        return []

    def _call_delta(self, args: str) -> dict[str, Any]:
        if self.started:
            return {"index": 0, "function": {"arguments": args}}
        self.started = True
        return {"index": 0, "id": self.call_id, "type": "function",
                "function": {"name": self.plan.function, "arguments": args}}

    def finish(self, new_text: str, full_text: str, finish_reason: str) -> tuple[list[dict[str, Any]], str]:
        """Deltas for the last piece, and the choice's finish reason."""
        if self.streaming:
            return ([{"content": new_text}] if new_text else []), finish_reason
        if self.plan.mode == "named":
            deltas = self.feed(new_text)
            _, calls, reason = self.plan.finish(full_text, finish_reason)
            if calls and not self.started:
                deltas.append({"tool_calls": [self._call_delta("")]})
            return deltas, reason
        self.held += new_text
        content, calls, reason = self.plan.finish(self.held, finish_reason)
        deltas: list[dict[str, Any]] = []
        if content:
            deltas.append({"content": content})
        if calls:
            deltas.append({"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]})
        return deltas, reason
