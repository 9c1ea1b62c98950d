"""The OpenAI Responses API, POST /v1/responses (server/responses_*.py, chat_blocks.py): input items as chat
messages, the store behind previous_response_id, the stream as the openai client assembles it (no model), and
the official `openai` client against the in-process app on smollm2-135m (the "generic" tool format)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, cast

import openai
import pytest
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent
from starlette.testclient import TestClient

from specserve.cli import build_parser
from specserve.cli.serve import server_settings
from specserve.engine.sampling import SamplingParams
from specserve.engine.tasks import Chunk, Result, Task
from specserve.errors import SpecserveError
from specserve.server.app import create_app
from specserve.server.chat_output import OutputSpec
from specserve.server.engine import Engine
from specserve.server.responses_format import ResponsesFormat
from specserve.server.responses_request import ResponsesRequest, conversation
from specserve.server.responses_store import ResponseNotFound, ResponseStore
from specserve.server.schemas import parse_body
from specserve.speculative.base import SpecParams
from tests import app_engine

WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = "What is the weather in Paris?"
GENERIC = OutputSpec(tool_format="generic", tool_names=frozenset({"get_weather"}))
HERMES = OutputSpec(tool_format="hermes", tool_names=frozenset({"get_weather"}))
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


# ---- requests as chat messages -----------------------------------------------------------------------------


def _request(**body: Any) -> ResponsesRequest:
    return parse_body(ResponsesRequest, json.dumps(body).encode())


def test_input_items_as_chat_messages() -> None:
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Hm."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city":"Lyon"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "Rain"}]},
    ]
    messages = conversation(_request(input=items).input_items())
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Hm.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "Rain"},
    ]
    # a call with no message before it is an assistant turn of its own
    alone = conversation([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}])
    assert alone == [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]


def test_the_chat_request_of_a_responses_request() -> None:
    req = _request(input=ASK, instructions="Answer in French.", tools=[WEATHER],
                   tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=7, temperature=0.5,
                   parallel_tool_calls=False, top_k=3)
    chat = req.chat(req.messages([{"role": "system", "content": "Be brief."}]))
    assert [m.role for m in chat.messages] == ["system", "user"]
    assert chat.messages[0].content == "Answer in French.\n\nBe brief."  # instructions, then the system text
    assert chat.tools == [{"type": "function", "function": {"name": "get_weather",
                                                            "description": WEATHER["description"],
                                                            "parameters": WEATHER["parameters"]}}]
    assert chat.choice() == {"type": "function", "function": {"name": "get_weather"}}
    assert (chat.max_tokens, chat.temperature, chat.top_k, chat.parallel_tool_calls) == (7, 0.5, 3, False)
    echo = req.echo()
    assert echo["tool_choice"] == {"type": "function", "name": "get_weather"} and echo["tools"][0]["name"]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    shaped = _request(input=ASK, text={"format": {"type": "json_schema", "name": "a", "schema": schema}})
    chat = shaped.chat(shaped.messages([]))
    assert chat.response_format is not None and chat.response_format.json_schema is not None
    assert chat.response_format.json_schema.schema_ == schema and shaped.echo()["text"]["format"]["name"] == "a"


@pytest.mark.parametrize(("body", "needle"), [
    ({"input": ""}, "input is empty"),
    ({"input": ASK, "tools": [{"type": "web_search"}]}, "tools.0"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0"),
    ({"input": ASK, "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "'nope'"),
    ({"input": ASK, "max_output_tokens": 0}, "max_output_tokens"),
])
def test_bad_requests(body: dict[str, Any], needle: str) -> None:
    with pytest.raises(SpecserveError, match=needle):
        req = _request(**body)
        req.chat(req.messages([]))


def test_the_store_gives_up_the_least_recently_used_and_the_expired() -> None:
    now = [0.0]
    store = ResponseStore(capacity=2, ttl=10.0, clock=lambda: now[0])
    store.put("a", [{"role": "user", "content": "a"}])
    store.put("b", [])
    store.conversation("a")  # a is used: b goes first
    store.put("c", [])
    with pytest.raises(ResponseNotFound):
        store.conversation("b")
    assert store.conversation("a") == [{"role": "user", "content": "a"}]
    now[0] = 11.0
    with pytest.raises(ResponseNotFound):
        store.conversation("c")
    off = ResponseStore(capacity=0)
    off.put("a", [])
    assert len(off) == 0


def test_responses_store_flag() -> None:
    def parsed(*flags: str) -> Any:
        return server_settings(build_parser().parse_args(["serve", "-m", "/nonexistent/model.gguf", *flags]))

    assert parsed().responses_store == 256 and parsed("--responses-store", "0").responses_store == 0
    with pytest.raises(SpecserveError, match="--responses-store"):
        parsed("--responses-store", "-1")


# ---- the stream, as the openai client assembles it -----------------------------------------------------------


class _Tokenizer:
    @staticmethod
    def encode(text: str, add_special: bool = False) -> list[int]:
        return [0] * len(text.split())


def _format(spec: OutputSpec) -> ResponsesFormat:
    engine = cast(Engine, SimpleNamespace(model_name="m", tokenizer=_Tokenizer()))
    echo = _request(input="x").echo()
    return ResponsesFormat(engine, Task([1], SamplingParams(), SpecParams()), spec, echo)


def _result(stop_type: str) -> Result:
    return Result(slot=0, stop_type=stop_type, stopping_word="", n_prompt=5, n_cached=2, n_predicted=9,
                  prompt_ms=1.0, predicted_ms=1.0, draft_n=0, draft_n_accepted=0)


def _shape(value: Any) -> Any:
    """Output items without their ids (each answer draws its own) and what the client adds (None fields)."""
    if isinstance(value, list):
        return [_shape(v) for v in value]
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items() if k not in ("id", "call_id") and v is not None}
    return value


@pytest.mark.parametrize(("text", "spec", "stop_type"), [
    ("<think>\nPlan: call it.\n</think>\n\nSure.\n" + HERMES_CALL + "\nDone.", HERMES, "eos"),
    ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}', GENERIC, "eos"),
    ("<think>The user says hi.</think>Hello there!", OutputSpec(), "limit"),
])
def test_stream_assembles_to_the_body(text: str, spec: OutputSpec, stop_type: str) -> None:
    fmt = _format(spec)
    deltas = [text[i:i + 3] for i in range(0, len(text), 3)]
    events = fmt.start() + [e for d in deltas for e in fmt.chunk(Chunk(d, [0]))] + fmt.final(_result(stop_type))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for event in events:
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=event))
    body = _format(spec).body([Chunk(text, [0])], _result(stop_type))
    last = events[-1]["response"]
    assert _shape(last["output"]) == _shape(body["output"]) and last["usage"] == body["usage"]
    assert last["status"] == body["status"] == ("incomplete" if stop_type == "limit" else "completed")
    if stop_type == "eos":  # the client's own assembly (it keeps a final response for completed ones only)
        final = cast(Any, state)._completed_response
        assert _shape([item.to_dict() for item in final.output]) == _shape(body["output"])


def test_items_of_a_reasoned_call() -> None:
    body = _format(HERMES).body([Chunk("<think>Plan.</think>Sure.\n" + HERMES_CALL + "\nDone.", [0])],
                                _result("limit"))
    assert _shape(body["output"]) == [
        {"type": "reasoning", "status": "completed", "summary": [], "content": [
            {"type": "reasoning_text", "text": "Plan."}]},
        {"type": "message", "role": "assistant", "status": "completed", "content": [
            {"type": "output_text", "text": "Sure.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "name": "get_weather", "arguments": '{"city":"Paris"}', "status": "completed"},
        {"type": "message", "role": "assistant", "status": "incomplete", "content": [
            {"type": "output_text", "text": "Done.", "annotations": [], "logprobs": []}]}]
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    failed = _format(HERMES)
    failed.start()
    event = failed.sse(failed.stream_error(500, "boom")).decode()
    assert event.startswith("event: error\ndata: ") and json.loads(event.split("data: ", 1)[1]) == {
        "type": "error", "sequence_number": 2, "code": "server_error", "message": "boom", "param": None}
    assert body["usage"] == {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 9,
                             "output_tokens_details": {"reasoning_tokens": 1}, "total_tokens": 14}


# ---- the server, through the openai client -----------------------------------------------------------------


@pytest.fixture(scope="module")
def client(http: TestClient) -> openai.OpenAI:
    return app_engine.openai_client(http)


def create(client: openai.OpenAI, **fields: Any) -> Any:
    body = {"model": "smollm2-135m", "input": ASK, "temperature": 0, "max_output_tokens": 32, **fields}
    return client.responses.create(**body)


def calls_of(response: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(item.name, json.loads(item.arguments)) for item in response.output if item.type == "function_call"]


def test_text_streamed_and_not(client: openai.OpenAI) -> None:
    body = {"input": "Say hello.", "max_output_tokens": 12}
    whole = create(client, **body)
    assert whole.id.startswith("resp_") and whole.object == "response" and whole.output_text
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 12 and whole.usage.total_tokens == whole.usage.input_tokens + 12
    stream = create(client, **body, stream=True)
    events = list(stream)
    assert [e.type for e in events[:4]] == ["response.created", "response.in_progress",
                                            "response.output_item.added", "response.content_part.added"]
    assert events[-1].type == "response.incomplete"
    streamed = events[-1].response
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert streamed.output_text == whole.output_text and streamed.status == whole.status
    assert streamed.usage.output_tokens == whole.usage.output_tokens


def test_a_completed_stream_is_the_final_response(client: openai.OpenAI) -> None:
    body = {"model": "smollm2-135m", "input": ASK, "tools": [WEATHER], "tool_choice": "required",
            "temperature": 0, "max_output_tokens": 48, "parallel_tool_calls": False}
    whole = client.responses.create(**body)
    with client.responses.stream(**body) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    assert whole.status == final.status == "completed"
    assert calls_of(final) == calls_of(whole) and calls_of(whole)
    assert _shape([i.to_dict() for i in final.output]) == _shape([i.to_dict() for i in whole.output])


def test_required_gives_a_call(client: openai.OpenAI) -> None:
    response = create(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    ((name, arguments),) = calls_of(response)
    call = response.output[-1]
    assert name == "get_weather" and set(arguments) == {"city"} and call.call_id.startswith("call_")
    assert call.id.startswith("fc_") and response.status == "completed" and not response.output_text


def test_two_turns_with_items_and_with_previous_response_id(client: openai.OpenAI, http: TestClient) -> None:
    first = create(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    call = first.output[-1]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 22 C"}
    items = [{"role": "user", "content": ASK}, *[i.model_dump(exclude_none=True) for i in first.output], result]
    by_items = create(client, input=items, tools=[WEATHER], tool_choice="none")
    by_id = create(client, input=[result], previous_response_id=first.id, tools=[WEATHER], tool_choice="none")
    assert by_items.output_text and by_id.output_text == by_items.output_text  # the same conversation
    assert by_id.usage.input_tokens == by_items.usage.input_tokens
    assert by_id.previous_response_id == first.id
    stored = cast(Any, http.app).state.server.responses.conversation(by_id.id)
    assert [m["role"] for m in stored] == ["user", "assistant", "tool", "assistant"]
    assert stored[2]["content"] == "Sunny, 22 C" and stored[3]["content"] == by_id.output_text


def test_instructions_are_not_carried_over(client: openai.OpenAI, http: TestClient) -> None:
    told = create(client, input="Hi", instructions="You are a pirate.", max_output_tokens=2)
    chat = client.chat.completions.create(model="smollm2-135m", max_tokens=1, messages=[
        {"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hi"}])
    assert told.instructions == "You are a pirate." and told.usage.input_tokens == cast(Any, chat.usage).prompt_tokens
    stored = cast(Any, http.app).state.server.responses.conversation(told.id)
    assert [m["role"] for m in stored] == ["user", "assistant"]


def test_unknown_or_unstored_previous_response_is_404(client: openai.OpenAI) -> None:
    kept_out = create(client, input="Hi", max_output_tokens=2, store=False)
    for response_id in ("resp_nope", kept_out.id):
        with pytest.raises(openai.NotFoundError) as info:
            create(client, input="Again", previous_response_id=response_id, max_output_tokens=2)
        assert info.value.code == "previous_response_not_found" and response_id in info.value.message


def test_reasoning_item(client: openai.OpenAI) -> None:
    # the prompt opens the thinking block (an assistant prefill): the answer starts as reasoning
    body = {"input": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>"}],
            "max_output_tokens": 8}
    response = create(client, **body)
    (item,) = response.output
    assert item.type == "reasoning" and item.id.startswith("rs_") and item.content[0].text
    assert 0 < response.usage.output_tokens_details.reasoning_tokens <= 8
    events = list(create(client, **body, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == item.content[0].text


def test_bad_request_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        create(client, tools=[{"type": "file_search", "vector_store_ids": ["x"]}])
    assert info.value.status_code == 400 and "tools.0" in info.value.message
    other = create(client, model="gpt-5", max_output_tokens=1)  # any name: the one model
    assert other.status in ("incomplete", "completed") and other.model == "smollm2-135m"


def test_with_an_api_key() -> None:
    app = create_app(app_engine.SETTINGS, api_key="secret", engine=app_engine.engine())
    http = TestClient(app)
    keyed = app_engine.openai_client(http, "secret")
    assert create(keyed, input="Hi", max_output_tokens=1).status == "incomplete"
    wrong = app_engine.openai_client(http, "wrong")
    with pytest.raises(openai.AuthenticationError):
        create(wrong, input="Hi", max_output_tokens=1)


def test_input_tokens_count_the_prompt(client: openai.OpenAI, http: TestClient) -> None:
    """OpenAI's /v1/responses/input_tokens and the same for chat: the prompt tokens the request would have."""
    counted = client.responses.input_tokens.count(model="smollm2-135m", input=ASK)
    answer = create(client, input=ASK, max_output_tokens=1)
    assert counted.object == "response.input_tokens" and counted.input_tokens == answer.usage.input_tokens
    chat = {"model": "any", "messages": [{"role": "user", "content": "Say hello."}]}
    count = http.post("/v1/chat/completions/input_tokens", json=chat).json()
    done = http.post("/v1/chat/completions", json={**chat, "max_tokens": 1}).json()
    assert count == {"object": "chat.completion.input_tokens", "input_tokens": done["usage"]["prompt_tokens"]}
    assert http.post("/chat/completions/input_tokens", json={"messages": []}).status_code == 400
