"""Constrained output over HTTP: grammar, json_schema and response_format on the three generation endpoints."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from tests.server_utils import ServerProcess

YES_NO = 'root ::= " yes" | " no"'
PERSON = {"type": "object", "required": ["name", "age"], "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 150}}}
REPEATING = "a b c d e f g h, a b c d e f g h, a b c d e f g h, a b c d e f g h, a b c"
LETTERS = 'root ::= (" " [a-e] | ",")+'
CHAT = [{"role": "user", "content": "Give me a JSON object with a name and an age."}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = ServerProcess("-m", "smollm2-135m", "--device", "cpu", "-np", "2", "-c", "2048")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def check_person(value: Any) -> None:
    """PERSON's constraints, checked by hand (no jsonschema package here)."""
    assert isinstance(value, dict) and {"name", "age"} <= value.keys()
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 150


def chat(server: ServerProcess, **fields: Any) -> dict[str, Any]:
    r = server.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 64, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_completion_grammar(server: ServerProcess) -> None:
    out = server.complete("Is the sky blue? Answer yes or no:", n_predict=8, grammar=YES_NO)
    assert out["content"] in (" yes", " no")
    assert out["stop_type"] == "eos" and out["stop"] is True
    assert out["generation_settings"]["grammar"] == YES_NO


def test_v1_completions_json_schema(server: ServerProcess) -> None:
    r = server.post("/v1/completions", {"prompt": "Write a JSON object describing a person:\n", "max_tokens": 64,
                                         "temperature": 0, "json_schema": PERSON})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    check_person(json.loads(choice["text"]))
    assert choice["finish_reason"] == "stop"


def test_chat_response_format_json_object_and_schema(server: ServerProcess) -> None:
    plain = chat(server, max_tokens=8)["choices"][0]["message"]["content"]
    with pytest.raises(json.JSONDecodeError):
        json.loads(plain)  # (unconstrained, this model answers in prose)
    anything = chat(server, response_format={"type": "json_object"})["choices"][0]
    assert isinstance(json.loads(anything["message"]["content"]), dict)
    assert anything["finish_reason"] == "stop"
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    check_person(json.loads(chat(server, response_format=schema)["choices"][0]["message"]["content"]))


def test_chat_stream_with_a_schema(server: ServerProcess) -> None:
    body = {"messages": CHAT, "max_tokens": 64, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}
    full = chat(server, **{k: v for k, v in body.items() if k != "messages"})["choices"][0]["message"]["content"]
    events = list(server.stream("/v1/chat/completions", {**body, "stream": True}))
    assert events[-1] == "[DONE]"
    parts = [e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"]]
    assert len([p for p in parts if p]) > 1 and "".join(parts) == full
    check_person(json.loads(full))
    finish = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]]
    assert finish[-1] == "stop"


@pytest.mark.parametrize("spec_type", ["ngram-simple", "ngram-suffix"])
def test_speculation_under_a_grammar(server: ServerProcess, spec_type: str) -> None:
    plain = server.complete(REPEATING, n_predict=24, grammar=LETTERS)
    spec = server.complete(REPEATING, n_predict=24, grammar=LETTERS, **{
        "speculative.type": spec_type, "speculative.n_max": 8, "speculative.ngram_size_n": 2})
    assert spec["content"] == plain["content"] and set(plain["content"]) <= set(" abcde,")
    t = spec["timings"]
    assert 0 < t["draft_n_accepted"] < t["draft_n"]  # the history's " f g h" drafts are rejected


def test_without_constraints_nothing_changes(server: ServerProcess) -> None:
    plain = server.complete("The three primary colors are", n_predict=8)
    for fields in ({"grammar": ""}, {"response_format": {"type": "text"}}):
        out = server.complete("The three primary colors are", n_predict=8, **fields)
        assert out["content"] == plain["content"] and out["generation_settings"]["grammar"] == ""


@pytest.mark.parametrize(("path", "fields", "problem"), [
    ("/completion", {"grammar": "root ::= nope"}, "invalid grammar: .*Rule 'nope' not found"),
    ("/v1/completions", {"grammar": 'root ::= ("a"'}, "invalid grammar: "),
    ("/v1/chat/completions", {"grammar": 'answer ::= "x"'}, "invalid grammar: .*No 'root' rule"),
    ("/completion", {"json_schema": {"type": "wrong"}}, "invalid json_schema: Invalid type: wrong"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#/$defs/missing"}}}}, "invalid json_schema: .*does not exist"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "needs a json_schema object"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("/completion", {"grammar": YES_NO, "json_schema": PERSON}, "not grammar and json_schema"),
    ("/v1/completions", {"json_schema": PERSON, "response_format": {"type": "json_object"}},
     "not json_schema and response_format"),
])
def test_bad_constraints_are_400(server: ServerProcess, path: str, fields: dict[str, Any], problem: str) -> None:
    body: dict[str, Any] = {"messages": CHAT} if "chat" in path else {"prompt": "Hi"}
    r = server.post(path, {**body, "max_tokens": 4, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert re.search(problem, error["message"]), error["message"]
