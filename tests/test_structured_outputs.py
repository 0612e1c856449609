"""Structured outputs against the real server on a random tiny model: ``response_format``
(json_schema, json_object, text), vLLM's ``guided_*`` and ``structured_outputs`` on both
endpoints, 400s for what cannot be enforced, truthful ``finish_reason``, and parallel tool calls.

A random model under a grammar must still produce output the grammar accepts; the schemas
bound their strings and numbers so that it always ends within ``max_tokens``."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from mindie_host.structured.spec import parse_structured
from mindie_host.testing import RunningServer, server_config

MODEL = "tiny"
HI = [{"role": "user", "content": "Describe a person."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
        "ok": {"type": "boolean"},
        "pet": {"anyOf": [{"$ref": "#/$defs/Pet"}, {"type": "null"}]},
    },
    "required": ["name", "age", "role", "ok", "pet"],
    "additionalProperties": False,
    "$defs": {"Pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}},
                      "required": ["kind"], "additionalProperties": False}},
}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
CALLS = {  # two calls of ``add`` as a JSON list, which the model family's parser reads as parallel calls
    "type": "array", "minItems": 2, "maxItems": 2,
    "items": {"type": "object", "additionalProperties": False, "required": ["name", "arguments"], "properties": {
        "name": {"const": "add"},
        "arguments": {"type": "object", "additionalProperties": False, "required": ["a", "b"], "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0,
                                                                         "maximum": 99}}}}},
}


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=120)


def chat(server, **body) -> httpx.Response:
    return post(server, "/v1/chat/completions", {"messages": HI, **body})


def sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_json_schema_random_model_always_valid(tiny_server):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = chat(tiny_server, response_format=rf, n=4, temperature=1.0, seed=3, max_tokens=120)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


def test_json_schema_stream(tiny_server):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = chat(tiny_server, response_format=rf, temperature=1.0, seed=5, max_tokens=120, stream=True)
    events = [e for e in sse(r.text) if e["choices"]]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    jsonschema.validate(json.loads(text), PERSON)
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_cut_output_says_length(tiny_server):
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
    r = chat(tiny_server, response_format=rf, temperature=1.0, seed=1, max_tokens=4)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"].startswith('{"text": "')


def test_json_object_and_text(tiny_server):
    r = chat(tiny_server, response_format={"type": "json_object"}, temperature=0, max_tokens=60)
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:  # a random model may not close the object in time; what it wrote is still an object's prefix
        assert choice["finish_reason"] == "length" and choice["message"]["content"].startswith("{")
    schema = {"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"]}
    r = chat(tiny_server, response_format={"type": "json_object", "schema": schema}, max_tokens=30)
    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), schema)
    assert chat(tiny_server, response_format={"type": "text"}, max_tokens=3).status_code == 200


@pytest.mark.parametrize("extra,field", [
    ({"response_format": {"type": "bogus"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "format": "no-such-format"}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "text", "schema": {}}}, "response_format.schema"),
    ({"guided_regex": "(a"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "start: nothing_defined"}, "guided_grammar"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"what": 1}}, "structured_outputs.what"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
])
def test_unenforceable_requests_are_refused(tiny_server, extra, field):
    for path, base in (("/v1/chat/completions", {"messages": HI}), ("/v1/completions", {"prompt": "Hi"})):
        r = post(tiny_server, path, {**base, "max_tokens": 4, **extra})
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["param"] == field and err["type"] == "invalid_request_error" and err["message"]


def test_response_format_with_forced_tool_choice_refused(tiny_server):
    r = chat(tiny_server, tools=[ADD], tool_choice="required", response_format={"type": "json_object"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


@pytest.mark.parametrize("extra,check", [
    ({"guided_regex": r"[a-z]{3}-\d{2}"}, lambda t: re.fullmatch(r"[a-z]{3}-\d{2}", t)),
    ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"guided_grammar": 'start: "x" ("+" "x"){1,3}'}, lambda t: re.fullmatch(r"x(\+x){1,3}", t)),
    ({"guided_grammar": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),  # GBNF
    ({"guided_json": {"type": "object", "properties": {"v": {"type": "boolean"}}, "required": ["v"],
                      "additionalProperties": False}},
     lambda t: isinstance(json.loads(t)["v"], bool)),
    ({"structured_outputs": {"regex": r"\d{4}"}}, lambda t: re.fullmatch(r"\d{4}", t)),
    ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
     lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
])
def test_guided_decoding_on_completions_and_chat(tiny_server, extra, check):
    for seed in (1, 2):
        r = post(tiny_server, "/v1/completions", {"prompt": "Answer:", "max_tokens": 100, "temperature": 1.0,
                                                  "seed": seed, **extra})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and check(choice["text"]), choice
    r = chat(tiny_server, max_tokens=100, temperature=1.0, seed=7, **extra)
    assert check(r.json()["choices"][0]["message"]["content"])


def test_parse_structured_text_is_no_constraint():
    assert parse_structured({"response_format": {"type": "text"}}) is None
    assert parse_structured({"structured_outputs": {"json_object": True}}).value == {"type": "object"}


# -- parallel tool calls ----------------------------------------------------------------------------
def test_parallel_tool_calls(tiny_server):
    """The model's output holds two calls (forced here by a JSON-list schema): both come back."""
    body = {"tools": [ADD], "structured_outputs": {"json": CALLS}, "max_tokens": 80, "temperature": 1.0, "seed": 2}
    r = chat(tiny_server, **body)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    calls = choice["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["add", "add"]
    assert len({c["id"] for c in calls}) == 2
    for c in calls:
        assert set(json.loads(c["function"]["arguments"])) == {"a", "b"}
    r = chat(tiny_server, **body, parallel_tool_calls=False)
    assert len(r.json()["choices"][0]["message"]["tool_calls"]) == 1
    stream = chat(tiny_server, **body, stream=True)
    deltas = [t for e in sse(stream.text) if e["choices"] for t in (e["choices"][0]["delta"].get("tool_calls") or [])]
    assert [d["index"] for d in deltas] == [0, 1]
    assert [d["function"]["arguments"] for d in deltas] == [c["function"]["arguments"] for c in calls]
    assert chat(tiny_server, tools=[ADD], parallel_tool_calls="yes").status_code in (400, 422)



def test_required_tool_choice_with_rich_schema(tiny_server):
    """A tool schema beyond the builtin decoder's subset (bounds, anyOf) is enforced in full by llguidance."""
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "required": ["n", "tag"], "properties": {
            "n": {"type": "integer", "minimum": 3, "maximum": 9},
            "tag": {"anyOf": [{"type": "string", "pattern": "^[a-c]{2}$"}, {"type": "null"}]}}}}}
    for choice in ("required", {"type": "function", "function": {"name": "pick"}}):
        for seed in (1, 2, 3):
            r = chat(tiny_server, tools=[tool], tool_choice=choice, max_tokens=60, temperature=1.0, seed=seed,
                     parallel_tool_calls=False)
            body = r.json()["choices"][0]
            assert body["finish_reason"] == "tool_calls", body
            (call,) = body["message"]["tool_calls"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])


@pytest.mark.parametrize("path,extra,field", [
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"audio": {"voice": "alloy"}}, "audio"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"store": True}, "store"),
    ("/v1/chat/completions", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
])
def test_unimplemented_openai_fields_are_refused(tiny_server, path, extra, field):
    base = {"messages": HI} if "chat" in path else {"prompt": "Hi"}
    r = post(tiny_server, path, {**base, "max_tokens": 2, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    ok = {"modalities": ["text"], "store": False, "best_of": 1}
    if field in ok:
        assert post(tiny_server, path, {**base, "max_tokens": 2, field: ok[field]}).status_code == 200


def test_structured_outputs_with_engine_process(tiny_model):
    """With the engine in its own process the constraint travels pickled and still holds."""
    with RunningServer(server_config(tiny_model, server={"engineProcess": True})) as srv:
        rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
        r = chat(srv, response_format=rf, temperature=1.0, seed=9, max_tokens=120)
        jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), PERSON)
        r = post(srv, "/v1/completions", {"prompt": "x", "guided_choice": ["on", "off"], "max_tokens": 5})
        assert r.json()["choices"][0]["text"] in ("on", "off")


def test_a_pickled_constraint_carries_no_tokenizer_text(tiny_server):
    """The engine process gets each constraint as a few hundred bytes; the tokenizer's JSON crosses once, by file."""
    import pickle

    from mindie_host.structured.llg import _REBUILT, GrammarConstraint
    from mindie_host.structured.spec import StructuredSpec

    host = tiny_server.host
    constraint = GrammarConstraint.for_spec(host, StructuredSpec("choice", ["on", "off"], "guided_choice"))
    blob = pickle.dumps(constraint)
    assert len(blob) < 4096 < len(constraint.tokenizer.spec)
    _REBUILT.clear()  # as in a fresh engine process: the tokenizer is rebuilt from the file
    again = pickle.loads(blob)
    assert again.tokenizer.key == constraint.tokenizer.key
    allowed = set(again([]).tolist())
    assert allowed and allowed == set(constraint([]).tolist())
