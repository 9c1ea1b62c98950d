"""Fuzzing the API.

- schemathesis over GET /openapi.json, every operation, against the ASGI app on one in-process engine
  (tests/app_engine.py): no answer may be a 5xx, and every answer must match the schema (a documented status
  code, its content type, its body schema). A few examples per operation by default; `-m slow` runs many.
- hypothesis over the request models: valid bodies mutated at random, and any JSON at all, through
  `parse_body`: it returns a model or raises SpecserveError (a 400), nothing else.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from specserve.errors import SpecserveError
from specserve.server import schemas, utility_schemas
from specserve.server.messages_request import MessagesRequest
from specserve.server.responses_request import ResponsesRequest
from tests import app_engine

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import checks  # noqa: E402

CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
          checks.response_schema_conformance]
# Generation stays short on a CPU: at most this many tokens a request, whatever the example asked for.
MAX_TOKENS = 4
_LENGTH_FIELDS = ("n_predict", "max_tokens", "max_completion_tokens", "max_output_tokens")


@pytest.fixture(scope="module")
def api_schema() -> Any:
    return schemathesis.openapi.from_asgi("/openapi.json", app_engine.app())


def _bounded(case: Any) -> None:
    """Cap what a generation example may ask for (the server's default, -n, is already MAX_TOKENS)."""
    body = case.body if isinstance(case.body, dict) else None
    if body is None:
        return
    for key in _LENGTH_FIELDS:
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and (value > MAX_TOKENS or value == -1):
            body[key] = MAX_TOKENS


def _fuzz(api_schema: Any, max_examples: int) -> None:
    """Each operation's examples (schemathesis' own pytest plugin does not run under pytest 9: hypothesis
    drives its strategies here); every failing operation is reported, not only the first."""
    failures = []
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 15
    for op in operations:
        @given(case=op.as_strategy())
        @settings(max_examples=max_examples, deadline=None, suppress_health_check=list(HealthCheck),
                  phases=[Phase.explicit, Phase.generate], derandomize=True, database=None)
        def run(case: Any) -> None:
            _bounded(case)
            case.validate_response(case.call(), checks=CHECKS)

        try:
            run()
        except (Exception, BaseExceptionGroup) as exc:  # a check failed (schemathesis' FailureGroup) or the call
            failures.append(f"{op.label}: {type(exc).__name__}: {str(exc)[:600]}")
    assert not failures, "\n".join(failures)


def test_schemathesis_every_operation(api_schema: Any) -> None:
    _fuzz(api_schema, max_examples=3)


@pytest.mark.slow
def test_schemathesis_every_operation_long(api_schema: Any) -> None:
    _fuzz(api_schema, max_examples=60)


# ---- hypothesis over the request models (no model needed) ---------------------------------------------

VALID: dict[type[BaseModel], dict[str, Any]] = {
    schemas.CompletionRequest: {"prompt": "Hi", "n_predict": 4, "temperature": 0.5, "stop": ["x"],
                        "speculative.n_max": 4, "grammar": "root ::= \"a\""},
    schemas.OpenAICompletionRequest: {"prompt": [1, 2, 3], "max_tokens": 3, "logprobs": 2, "echo": True},
    schemas.ChatRequest: {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 2,
                  "response_format": {"type": "json_object"}, "stream_options": {"include_usage": True}},
    schemas.ApplyTemplateRequest: {"messages": [{"role": "system", "content": [{"type": "text", "text": "x"}]}]},
    utility_schemas.TokenizeRequest: {"content": "Hello", "with_pieces": True},
    utility_schemas.DetokenizeRequest: {"tokens": [1, 2]},
    ResponsesRequest: {"input": [{"role": "user", "content": "Hi"}, {"type": "function_call_output", "call_id": "c",
                                                                      "output": "x"}], "max_output_tokens": 3},
    MessagesRequest: {"max_tokens": 3, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                      "tool_choice": {"type": "any"}, "stop_sequences": ["x"]},
}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12)
field_names = st.sampled_from(sorted({k for body in VALID.values() for k in body} | {
    "speculative.type", "speculative.p_min", "seed", "top_p", "messages", "json_schema", "n", "suffix", "tools",
    "input", "system", "instructions"}))


@st.composite
def mutated(draw: st.DrawFn) -> tuple[type[BaseModel], dict[str, Any]]:
    model = draw(st.sampled_from(list(VALID)))
    body = json.loads(json.dumps(VALID[model]))
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["set", "drop", "add"]))
        key = draw(st.sampled_from(sorted(body))) if body and action != "add" else draw(field_names)
        if action == "drop":
            body.pop(key, None)
        else:
            body[key] = draw(json_values)
    return model, body


def _parses_or_400(model: type[BaseModel], raw: bytes) -> None:
    try:
        req = schemas.parse_body(model, raw)
        if isinstance(req, ResponsesRequest):  # these become chat requests: that is part of their parsing
            req.chat(req.messages([]))
        elif isinstance(req, MessagesRequest):
            req.chat()
    except SpecserveError as exc:
        assert str(exc)  # a message for the 400
    # anything else (TypeError, ValueError, RecursionError, ...) fails the test: it would be a 500


@given(mutated())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_mutated_bodies_parse_or_give_a_400(case: tuple[type[BaseModel], dict[str, Any]]) -> None:
    model, body = case
    _parses_or_400(model, json.dumps(body).encode())


@given(st.sampled_from(list(VALID)), json_values | st.binary(max_size=40).map(lambda b: b.decode("latin-1")))
@settings(max_examples=200, deadline=None)
def test_any_json_parses_or_gives_a_400(model: type[BaseModel], value: Any) -> None:
    _parses_or_400(model, json.dumps(value).encode())


@pytest.mark.parametrize("path", ["/embedding", "/embeddings", "/v1/embeddings"])
def test_embeddings_answer_as_documented(api_schema: Any, path: str) -> None:
    """A valid body on each embeddings route: llama-server's answer an array, OpenAI's an object, as the schema says
    (the random examples above reach a valid body only now and then)."""
    case = api_schema[path]["POST"].Case(body={"input": "hello world"})
    response = case.call()
    assert response.status_code == 200
    case.validate_response(response, checks=CHECKS)
