"""What a request asks its output to be: OpenAI's ``response_format`` and vLLM's guided-decoding fields.

:func:`parse_structured` reads, from a request body:

* ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``
  (any JSON object; an extra ``schema`` key, as Together/Anyscale and instructor's
  JSON_SCHEMA mode send it, constrains to that schema), or
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``;
* vLLM's ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``;
* vLLM's newer ``structured_outputs`` object with one of ``json``, ``regex``, ``choice``,
  ``grammar`` (``json_object: true`` too).

At most one of them may constrain a request. Anything malformed or unsupported is a
``RequestError`` (400) that names the field and says why; nothing is dropped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ..engine.request import RequestError

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
#: vLLM guided-decoding knobs this server does not implement: refused rather than ignored.
UNSUPPORTED = ("guided_decoding_backend", "guided_whitespace_pattern")
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class StructuredSpec:
    """One output constraint: ``kind`` is ``json`` (a JSON Schema), ``regex``, ``choice`` or ``grammar``."""

    kind: str
    value: Any
    #: the request field it came from, for error messages
    field: str


def _schema(value: Any, field: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise RequestError(f"{field} must be a JSON Schema object (or its JSON text)", field=field, status=400) from None
    if not isinstance(value, dict):
        raise RequestError(f"{field} must be a JSON Schema object", field=field, status=400)
    return value


def _checked(kind: str, value: Any, field: str) -> StructuredSpec:
    if kind == "json":
        return StructuredSpec("json", _schema(value, field), field)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise RequestError(f"{field} must be a non-empty list of strings", field=field, status=400)
        return StructuredSpec("choice", value, field)
    if not isinstance(value, str) or not value:
        raise RequestError(f"{field} must be a non-empty string", field=field, status=400)
    return StructuredSpec(kind, value, field)


def _response_format(rf: Any) -> StructuredSpec | None:
    field = "response_format"
    if not isinstance(rf, dict):
        raise RequestError("response_format must be an object with a type", field=field, status=400)
    kind = rf.get("type")
    allowed = {"text": {"type"}, "json_object": {"type", "schema"}, "json_schema": {"type", "json_schema"}}
    if kind not in allowed:
        raise RequestError(f"response_format.type must be one of {list(allowed)}, got {kind!r}",
                           field="response_format.type", status=400)
    extra = sorted(set(rf) - allowed[kind])
    if extra:
        raise RequestError(f"response_format of type {kind!r} does not take {extra}", field=f"{field}.{extra[0]}", status=400)
    if kind == "text":
        return None
    if kind == "json_object":
        if rf.get("schema") is not None:
            return StructuredSpec("json", _schema(rf["schema"], f"{field}.schema"), f"{field}.schema")
        return StructuredSpec("json", {"type": "object"}, field)
    js = rf.get("json_schema")
    where = f"{field}.json_schema"
    if not isinstance(js, dict):
        raise RequestError(f"{where} must be an object with name and schema", field=where, status=400)
    unknown = sorted(set(js) - {"name", "schema", "strict", "description"})
    if unknown:
        raise RequestError(f"{where} does not take {unknown}", field=f"{where}.{unknown[0]}", status=400)
    name = js.get("name")
    if not isinstance(name, str) or not SCHEMA_NAME.match(name):
        raise RequestError(f"{where}.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
                           field=f"{where}.name", status=400)
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise RequestError(f"{where}.strict must be a boolean", field=f"{where}.strict", status=400)
    if js.get("schema") is None:
        raise RequestError(f"{where}.schema is required: the JSON Schema the output must match",
                           field=f"{where}.schema", status=400)
    return StructuredSpec("json", _schema(js["schema"], f"{where}.schema"), f"{where}.schema")


def _structured_outputs(so: Any) -> StructuredSpec | None:
    field = "structured_outputs"
    if not isinstance(so, dict):
        raise RequestError(f"{field} must be an object with one of {list(STRUCTURED_KEYS)}", field=field, status=400)
    unknown = sorted(set(so) - set(STRUCTURED_KEYS))
    if unknown:
        raise RequestError(f"{field} supports only {list(STRUCTURED_KEYS)}, got {unknown}",
                           field=f"{field}.{unknown[0]}", status=400)
    given = [k for k in STRUCTURED_KEYS if so.get(k) not in (None, False)]
    if len(given) > 1:
        raise RequestError(f"{field} must set exactly one of {list(STRUCTURED_KEYS)}, got {given}", field=field, status=400)
    if not given:
        return None
    key = given[0]
    if key == "json_object":
        if so[key] is not True:
            raise RequestError(f"{field}.json_object must be a boolean", field=f"{field}.json_object", status=400)
        return StructuredSpec("json", {"type": "object"}, f"{field}.json_object")
    return _checked(key, so[key], f"{field}.{key}")


def parse_structured(body: dict[str, Any]) -> StructuredSpec | None:
    """The one output constraint ``body`` asks for, or None; a 400 for anything malformed or unsupported."""
    for key in UNSUPPORTED:
        if body.get(key) is not None:
            raise RequestError(f"{key} is not supported: this server has one structured-output engine "
                               "(llguidance) and writes JSON compactly", field=key, status=400)
    specs: list[StructuredSpec] = []
    if body.get("response_format") is not None:
        spec = _response_format(body["response_format"])
        if spec is not None:
            specs.append(spec)
    for key, kind in GUIDED.items():
        if body.get(key) is not None:
            specs.append(_checked(kind, body[key], key))
    if body.get("structured_outputs") is not None:
        spec = _structured_outputs(body["structured_outputs"])
        if spec is not None:
            specs.append(spec)
    if len(specs) > 1:
        raise RequestError(f"only one output constraint may be given, got {[s.field for s in specs]}",
                           field=specs[1].field, status=400)
    return specs[0] if specs else None
