"""The Anthropic Messages API, POST /v1/messages and /v1/messages/count_tokens (server/messages_*.py): messages
as chat messages, the stream as the anthropic client assembles it (no model), and the official `anthropic`
client against the in-process app on smollm2-135m (the "generic" tool format), with its errors and x-api-key."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, cast

import anthropic
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from starlette.testclient import TestClient

from specserve.engine.sampling import SamplingParams
from specserve.engine.tasks import Chunk, Result, Task
from specserve.errors import SpecserveError
from specserve.server.app import create_app
from specserve.server.chat_output import OutputSpec
from specserve.server.engine import Engine
from specserve.server.messages_format import MessagesFormat, stop_reason
from specserve.server.messages_request import MessagesRequest
from specserve.server.schemas import parse_body
from specserve.speculative.base import SpecParams
from tests import app_engine

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city", "input_schema": SCHEMA}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES = OutputSpec(tool_format="hermes", tool_names=frozenset({"get_weather"}))
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
GREEDY = {"temperature": 0}  # (the anthropic client has no temperature argument: it goes as an extra field)
ANY_ONE = {"type": "any", "disable_parallel_tool_use": True}  # (a small model given room goes on to more calls)


# ---- requests as chat messages -----------------------------------------------------------------------------


def _request(**body: Any) -> MessagesRequest:
    return parse_body(MessagesRequest, json.dumps({"max_tokens": 8, "messages": ASK, **body}).encode())


def test_messages_as_chat_messages() -> None:
    messages = [
        *ASK,
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Look it up.", "signature": "s"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Sunny"}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no such city", "is_error": True},
            {"type": "text", "text": "And"}, {"type": "text", "text": "tomorrow?"}]},
    ]
    req = _request(system=[{"type": "text", "text": "Be brief."}], messages=messages, tools=[WEATHER],
                   tool_choice={"type": "any", "disable_parallel_tool_use": True}, stop_sequences=["\n\n"],
                   top_k=5, thinking={"type": "enabled", "budget_tokens": 1024}, min_p=0.1)
    body = req.chat_body()
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        *ASK,
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Look it up.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no such city"},
        {"role": "user", "content": "And\n\ntomorrow?"},
    ]
    assert body["tools"] == [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA,
                                                               "description": WEATHER["description"]}}]
    assert (body["tool_choice"], body["parallel_tool_calls"], body["stop"]) == ("required", False, ["\n\n"])
    assert (body["top_k"], body["min_p"], body["max_tokens"]) == (5, 0.1, 8)
    assert body["chat_template_kwargs"] == {"enable_thinking": True}
    chat = req.chat()
    assert chat.choice() == "required" and chat.messages[2].tool_calls[0]["id"] == "toolu_1"  # type: ignore[attr-defined]
    named = _request(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}).chat()
    assert named.choice() == {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(("body", "needle"), [
    ({"max_tokens": 0}, "max_tokens"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "needs the tool's name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "'nope'"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0"),
])
def test_bad_requests(body: dict[str, Any], needle: str) -> None:
    with pytest.raises(SpecserveError, match=needle):
        _request(**body).chat()


def test_stop_reasons() -> None:
    def result(stop_type: str, word: str = "") -> Result:
        return Result(slot=0, stop_type=stop_type, stopping_word=word, n_prompt=5, n_cached=2, n_predicted=9,
                      prompt_ms=1.0, predicted_ms=1.0, draft_n=0, draft_n_accepted=0)

    assert stop_reason(result("eos"), 0) == ("end_turn", None)
    assert stop_reason(result("eos"), 1) == ("tool_use", None)
    assert stop_reason(result("limit"), 1) == ("max_tokens", None)
    assert stop_reason(result("word", "END"), 0) == ("stop_sequence", "END")


# ---- the stream, as the anthropic client assembles it --------------------------------------------------------


def _format(spec: OutputSpec) -> MessagesFormat:
    engine = cast(Engine, SimpleNamespace(model_name="m"))
    return MessagesFormat(engine, Task([1, 2, 3, 4, 5], SamplingParams(), SpecParams()), spec)


@pytest.mark.parametrize(("text", "spec"), [
    ("<think>\nPlan: call it.\n</think>\n\nSure.\n" + HERMES_CALL + "\nDone.", HERMES),
    ("<think>The user says hi.</think>Hello there!", OutputSpec()),
    ("Plain.", HERMES),
])
def test_stream_assembles_to_the_body(text: str, spec: OutputSpec) -> None:
    fmt = _format(spec)
    result = Result(slot=0, stop_type="eos", stopping_word="", n_prompt=5, n_cached=2, n_predicted=9,
                    prompt_ms=1.0, predicted_ms=1.0, draft_n=0, draft_n_accepted=0)
    deltas = [text[i:i + 3] for i in range(0, len(text), 3)]
    events = fmt.start() + [e for d in deltas for e in fmt.chunk(Chunk(d, [0]))] + fmt.final(result)
    snapshot, bufs = None, {}  # type: ignore[var-annotated]
    for event in events:
        snapshot = accumulate_event(event=cast(Any, event), current_snapshot=snapshot, json_bufs=bufs)
    body = _format(spec).body([Chunk(text, [0])], result)
    streamed = cast(Any, snapshot).to_dict()
    drop = {"id"}
    assert [{k: v for k, v in b.items() if k not in drop} for b in streamed["content"]] == \
        [{k: v for k, v in b.items() if k not in drop} for b in body["content"]]
    assert (streamed["stop_reason"], streamed["usage"]) == (body["stop_reason"], body["usage"])
    assert body["usage"] == {"input_tokens": 3, "output_tokens": 9, "cache_read_input_tokens": 2,
                             "cache_creation_input_tokens": 0}


def test_blocks_of_a_reasoned_call() -> None:
    fmt = _format(HERMES)
    body = fmt.body([Chunk("<think>Plan.</think>Sure.\n" + HERMES_CALL, [0])],
                    Result(slot=0, stop_type="eos", stopping_word="", n_prompt=5, n_cached=0, n_predicted=9,
                           prompt_ms=1.0, predicted_ms=1.0, draft_n=0, draft_n_accepted=0))
    content = body["content"]
    assert content[:2] == [{"type": "thinking", "thinking": "Plan.", "signature": ""},
                           {"type": "text", "text": "Sure."}]
    assert content[2]["type"] == "tool_use" and content[2]["input"] == {"city": "Paris"}
    assert body["stop_reason"] == "tool_use" and body["id"].startswith("msg_")
    assert fmt.error(400, "bad") == {"type": "error", "error": {"type": "invalid_request_error", "message": "bad"}}
    event = fmt.sse(fmt.stream_error(503, "full")).decode()
    assert event.startswith("event: error\ndata: ") and event.endswith("\n\n")
    assert json.loads(event.removeprefix("event: error\ndata: ")) == {
        "type": "error", "error": {"type": "overloaded_error", "message": "full"}}


# ---- the server, through the anthropic client --------------------------------------------------------------


@pytest.fixture(scope="module")
def client(http: TestClient) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url="http://testserver", api_key="x", http_client=http, max_retries=0)


def create(client: anthropic.Anthropic, **fields: Any) -> Any:
    body = {"model": "smollm2-135m", "messages": ASK, "max_tokens": 32, "extra_body": GREEDY, **fields}
    return client.messages.create(**body)


def test_text(client: anthropic.Anthropic) -> None:
    message = create(client, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.stop_reason == "max_tokens" and message.content[0].type == "text" and message.content[0].text
    assert message.usage.output_tokens == 12 and message.usage.input_tokens > 0


def test_stream_assembled_by_the_client(client: anthropic.Anthropic) -> None:
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 12,
            "extra_body": GREEDY}
    whole = client.messages.create(**body)
    with client.messages.stream(**body) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    total = final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0)
    assert total == whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)


def test_tool_use_round_trip(client: anthropic.Anthropic) -> None:
    first = create(client, tools=[WEATHER], tool_choice=ANY_ONE)
    (call,) = [block for block in first.content if block.type == "tool_use"]
    assert first.stop_reason == "tool_use" and call.name == "get_weather" and set(call.input) == {"city"}
    with client.messages.stream(model="smollm2-135m", messages=ASK, max_tokens=32, tools=[WEATHER],
                                tool_choice=ANY_ONE, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(call.name, call.input)]
    messages = [*ASK, {"role": "assistant", "content": [block.model_dump() for block in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                              "content": "Sunny, 22 C"}]}]
    final = create(client, messages=messages, tools=[WEATHER], tool_choice={"type": "none"})
    assert final.content[0].type == "text" and final.content[0].text
    assert final.stop_reason in ("end_turn", "max_tokens")


def test_count_tokens_is_the_prompt(client: anthropic.Anthropic) -> None:
    counted = client.messages.count_tokens(model="smollm2-135m", messages=ASK, tools=[WEATHER], system="Be brief.")
    message = create(client, max_tokens=1, tools=[WEATHER], system="Be brief.", tool_choice={"type": "none"})
    plain = client.messages.count_tokens(model="smollm2-135m", messages=ASK, system="Be brief.")
    assert counted.input_tokens > plain.input_tokens  # the tools are described in the prompt
    assert plain.input_tokens == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)


def test_thinking_block(client: anthropic.Anthropic) -> None:
    # the prompt opens the thinking block (an assistant prefill): the answer starts as reasoning
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>"}]
    message = create(client, messages=messages, max_tokens=8)
    (block,) = message.content
    assert block.type == "thinking" and block.thinking
    with client.messages.stream(model="smollm2-135m", messages=messages, max_tokens=8, extra_body=GREEDY) as stream:
        deltas = [e.delta.thinking for e in stream if e.type == "content_block_delta"]
    assert "".join(deltas) == block.thinking


def test_stop_sequence(client: anthropic.Anthropic) -> None:
    said = create(client, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12).content[0].text
    word = said.split()[1]
    stopped = create(client, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12,
                     stop_sequences=[word])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", word)
    assert word not in stopped.content[0].text


def test_errors_have_anthropics_shape(client: anthropic.Anthropic, http: TestClient) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, max_tokens=0)
    assert info.value.status_code == 400
    body = cast(dict, info.value.body)
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    assert create(client, model="claude-opus-4", max_tokens=1).model == "smollm2-135m"  # any name: the one model
    answer = http.post("/v1/messages", content=b"{not json")
    assert answer.status_code == 400 and answer.json()["type"] == "error"
    answer = http.post("/v1/messages/count_tokens", json={"messages": []})
    assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error"
    stream = http.post("/v1/messages", json={"messages": ASK, "max_tokens": 1, "stream": True})
    assert stream.text.startswith("event: message_start\ndata: ")


def test_x_api_key() -> None:
    http = TestClient(create_app(app_engine.SETTINGS, api_key="secret", engine=app_engine.engine()))
    keyed = anthropic.Anthropic(base_url="http://testserver", api_key="secret", http_client=http, max_retries=0)
    assert keyed.messages.count_tokens(model="smollm2-135m", messages=ASK).input_tokens > 0
    wrong = anthropic.Anthropic(base_url="http://testserver", api_key="wrong", http_client=http, max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        wrong.messages.count_tokens(model="smollm2-135m", messages=ASK)
    assert cast(dict, info.value.body)["error"]["type"] == "authentication_error"
    bare = http.post("/v1/messages", json={"messages": ASK, "max_tokens": 1})
    assert bare.status_code == 401 and bare.json() == {
        "type": "error", "error": {"type": "authentication_error", "message": "Invalid API Key"}}
    assert http.post("/v1/messages/count_tokens", json={"messages": ASK},
                     headers={"Authorization": "Bearer secret"}).status_code == 200
