"""Structured outputs and tool calls through the ecosystem's real clients, unchanged, against the real server:
the openai SDK's ``parse()`` and ``json_object``, instructor (JSON_SCHEMA and TOOLS modes) and LangChain's
``ChatOpenAI`` (``with_structured_output(method="json_schema")`` and ``bind_tools``).

A random tiny model under the grammar must still give objects the client validates; the models bound their
strings and numbers so that the output always ends. ``json_object`` (unbounded) uses the default model."""

from __future__ import annotations

import json
from typing import Literal

import instructor
import openai
import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, ConfigDict, Field

MODEL = "tiny"
ASK = [{"role": "user", "content": "Describe a person."}]


class Person(BaseModel):
    # no other keys: a random model would otherwise write free-form keys forever (the schema allows them)
    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user"]


class Add(BaseModel):
    """Add two integers."""

    model_config = ConfigDict(extra="forbid")
    a: int = Field(ge=-1000, le=1000)
    b: int = Field(ge=-1000, le=1000)


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0)


def test_openai_parse_returns_model(client):
    for seed in (1, 2, 3):
        r = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Person, max_tokens=80,
                                          temperature=1.0, seed=seed)
        assert isinstance(r.choices[0].message.parsed, Person)
        assert r.choices[0].finish_reason == "stop"


def test_openai_bad_response_format_is_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4,
                                       response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert "schema" in str(err.value)


@pytest.mark.slow
def test_openai_json_object_default_model(default_server):
    c = openai.OpenAI(base_url=default_server.url + "/v1", api_key="x", max_retries=0)
    r = c.chat.completions.create(
        model=default_server.host.model_name, response_format={"type": "json_object"}, max_tokens=120, temperature=0,
        messages=[{"role": "user", "content": "Give the capital of France as JSON with the key capital."}])
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("mode", [instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS])
def test_instructor_modes(client, mode):
    ic = instructor.from_openai(client, mode=mode)
    for seed in (1, 2):
        person = ic.chat.completions.create(model=MODEL, messages=ASK, response_model=Person, max_retries=1,
                                            max_tokens=80, temperature=1.0, seed=seed)
        assert isinstance(person, Person)


def test_langchain_structured_output_and_tools(tiny_server):
    llm = ChatOpenAI(model=MODEL, base_url=tiny_server.url + "/v1", api_key="x", max_tokens=80, temperature=1.0,
                     seed=4, max_retries=0)
    person = llm.with_structured_output(Person, method="json_schema").invoke("Describe a person.")
    assert isinstance(person, Person)
    msg = llm.bind_tools([Add], tool_choice="Add").invoke("What is 2 plus 3?")
    (call,) = msg.tool_calls
    assert call["name"] == "Add" and call["id"]
    Add(**call["args"])
    msg = llm.bind_tools([Add], tool_choice="required").invoke("What is 2 plus 3?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "Add"
