"""OpenAI tool calling and reasoning on /v1/chat/completions (server/chat_tools.py, chat_output.py,
generic_tools.py): answers read from stored outputs (no model), and the official `openai` client against the
in-process app on smollm2-135m, whose template has no tool syntax (the "generic" format)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, cast

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk
from starlette.testclient import TestClient

from specserve.cli import build_parser
from specserve.cli.serve import server_settings
from specserve.engine.sampling import SamplingParams
from specserve.engine.tasks import Chunk, Result, Task
from specserve.errors import SpecserveError
from specserve.gguf.tokenizer import IncrementalDecoder
from specserve.server import generic_tools
from specserve.server.chat_output import ChatOutput, OutputSpec, finish_reason, read_message
from specserve.server.chat_tools import ToolStyle, plan_tools, with_object_arguments
from specserve.server.engine import Engine
from specserve.server.formats import ChatFormat
from specserve.server.schemas import ChatTemplateFields
from specserve.speculative.base import SpecParams
from tests import app_engine

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES = OutputSpec(tool_format="hermes", tool_names=frozenset({"get_weather"}))
GENERIC = OutputSpec(tool_format="generic", tool_names=frozenset({"get_weather"}))
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


# ---- answers from stored outputs ---------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "spec", "expected"), [
    (HERMES_CALL, HERMES, (None, "", [("get_weather", '{"city":"Paris"}')])),
    ("Let me look.\n" + HERMES_CALL, HERMES, (None, "Let me look.", [("get_weather", '{"city":"Paris"}')])),
    ("<think>\nThe user wants Paris.\n</think>\n\n" + HERMES_CALL, HERMES,
     ("The user wants Paris.", "", [("get_weather", '{"city":"Paris"}')])),
    ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}', GENERIC,
     (None, "", [("get_weather", '{"city":"Paris"}')])),
    ('{"response": "Sunny."}', GENERIC, (None, "Sunny.", [])),
    # malformed calls are given back as they were written
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>', HERMES,
     (None, '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>', [])),
    ('<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>', HERMES,
     (None, '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>', [])),
    ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Par', GENERIC,
     (None, '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Par', [])),
    # tools off: a call's text is content; reasoning still splits
    ("<think>hm</think>" + HERMES_CALL, OutputSpec(), ("hm", HERMES_CALL, [])),
    ("<think>hm</think>Hi", OutputSpec(reasoning_format="none"), (None, "<think>hm</think>Hi", [])),
    ("I wonder.</think>Hi", OutputSpec(started_open=True), ("I wonder.", "Hi", [])),
])
def test_read_message(text: str, spec: OutputSpec, expected: tuple[str | None, str, list[tuple[str, str]]]) -> None:
    message = read_message(text, spec)
    assert (message.reasoning, message.content, [(c.name, c.arguments) for c in message.calls]) == expected


def test_finish_reason() -> None:
    assert finish_reason("stop", 1) == "tool_calls"
    assert finish_reason("length", 1) == "length"  # a cut answer says so, calls or not
    assert finish_reason("stop", 0) == "stop" and finish_reason("length", 0) == "length"


STORED = ["<think>\nPlan: call it.\n</think>\n\nSure.\n" + HERMES_CALL + "\nDone.",
          "<think>only thinking", "Plain answer.", "\n  " + HERMES_CALL + "\n" + HERMES_CALL]


@settings(max_examples=60, deadline=None)
@given(text=st.sampled_from(STORED), data=st.data())
def test_streamed_pieces_make_the_whole_message(text: str, data: st.DataObject) -> None:
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=8))))
    output = ChatOutput(HERMES)
    pieces = [p for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True) for p in output.feed(text[a:b])]
    pieces += output.finish()
    whole = read_message(text, HERMES)
    assert "".join(p.text for p in pieces if type(p).__name__ == "ReasoningDelta") == (whole.reasoning or "")
    assert "".join(p.text for p in pieces if type(p).__name__ == "ContentDelta") == whole.content
    assert output.n_calls == len(whole.calls)


# ---- the chat format: streamed chunks as the openai client assembles them ----------------------------------


def _format(spec: OutputSpec) -> ChatFormat:
    engine = cast(Engine, SimpleNamespace(model_name="m"))  # (model_name is all a chat format without logprobs reads)
    return ChatFormat(engine, Task([1], SamplingParams(), SpecParams()), output=spec)


def _result(stop_type: str) -> Result:
    return Result(slot=0, stop_type=stop_type, stopping_word="", n_prompt=1, n_cached=0, n_predicted=9,
                  prompt_ms=1.0, predicted_ms=1.0, draft_n=0, draft_n_accepted=0)


def _streamed(spec: OutputSpec, deltas: list[str], stop_type: str) -> tuple[list[dict[str, Any]], Any]:
    fmt = _format(spec)
    objs = fmt.start() + [o for d in deltas for o in fmt.chunk(Chunk(d, [0]))] + fmt.final(_result(stop_type))
    state = ChatCompletionStreamState()
    for obj in objs:
        state.handle_chunk(ChatCompletionChunk.model_validate(obj))
    return objs, state.current_completion_snapshot.choices[0]  # (get_final_completion refuses a "length" end)


@pytest.mark.parametrize(("text", "spec", "stop_type"), [
    ("<think>\nPlan: call it.\n</think>\n\nSure.\n" + HERMES_CALL, HERMES, "eos"),
    ("<think>The user says hi.</think>Hello!", OutputSpec(), "eos"),
    ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}', GENERIC, "eos"),
    ('{"tool_calls": [{"name": "get_weather", "arguments": {"ci', GENERIC, "limit"),
    ("Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"argu", HERMES, "limit"),
])
def test_stream_assembles_to_the_body(text: str, spec: OutputSpec, stop_type: str) -> None:
    deltas = [text[i:i + 3] for i in range(0, len(text), 3)]
    objs, streamed = _streamed(spec, deltas, stop_type)
    body = _format(spec).body([Chunk(text, [0])], _result(stop_type))["choices"][0]
    message = body["message"]
    assert streamed.finish_reason == body["finish_reason"]
    assert (streamed.message.content or "") == (message["content"] or "")
    assert getattr(streamed.message, "reasoning_content", None) == message.get("reasoning_content")
    calls = [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls or []]
    assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    for obj in objs[1:-1]:  # one kind of delta a chunk
        assert len(obj["choices"][0]["delta"]) == 1


def test_streamed_call_chunks_and_finish() -> None:
    objs, streamed = _streamed(HERMES, ["<tool_", "call>\n{\"name\": \"get_weather\", ", '"arguments": {"city": ',
                                        '"Paris"}}\n</tool_call>'], "eos")
    deltas = [o["choices"][0]["delta"] for o in objs]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0] == {"index": 0, "id": calls[0]["id"], "type": "function",
                        "function": {"name": "get_weather", "arguments": ""}}
    assert calls[1] == {"index": 0, "function": {"arguments": '{"city":"Paris"}'}}
    assert objs[-1]["choices"][0]["finish_reason"] == "tool_calls" and streamed.finish_reason == "tool_calls"
    assert not any("content" in d and d["content"] for d in deltas)


def test_text_held_to_the_end_comes_before_the_finish_chunk() -> None:
    objs, streamed = _streamed(HERMES, ["Hi <tool_c"], "eos")
    assert [o["choices"][0]["delta"] for o in objs[1:]] == [{"content": "Hi"}, {"content": " <tool_c"}, {}]
    assert streamed.message.content == "Hi <tool_c" and streamed.finish_reason == "stop"


# ---- prompts: tools, earlier calls and results -------------------------------------------------------------


CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 22 C"}


def _fields(**body: Any) -> ChatTemplateFields:
    return ChatTemplateFields.model_validate_json(json.dumps({"messages": ASK, **body}))


def test_object_arguments_for_templates_that_want_them() -> None:
    broken = {**CALLED, "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}]}
    out = with_object_arguments([ASK[0], CALLED, broken])
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert out[2]["tool_calls"][0]["function"]["arguments"] == "{not json"  # kept as it came
    assert CALLED["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # the request is untouched


def test_tool_plans_of_a_template_with_tool_syntax() -> None:
    style = ToolStyle("hermes", object_arguments=True, keep_special=frozenset({7}))
    auto = plan_tools(_fields(messages=[*ASK, CALLED, RESULT], tools=[WEATHER]), style)
    assert auto.tools == [WEATHER] and auto.grammar is None and auto.parse_format == "hermes"
    assert auto.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert auto.keep_special == {7} and auto.names == {"get_weather"}
    required = plan_tools(_fields(tools=[WEATHER], tool_choice="required"), style)
    assert required.grammar is not None and required.grammar.kind == "lark"
    assert "<tool_call>" in required.grammar.text
    assert plan_tools(_fields(tools=[WEATHER], tool_choice="required"), style, own_constraint=True).grammar is None
    none = plan_tools(_fields(tools=[WEATHER], tool_choice="none"), style)
    assert (none.tools, none.grammar, none.parse_format, none.keep_special) == (None, None, None, frozenset())


def test_generic_prompt_describes_the_tools() -> None:
    style = ToolStyle("generic")
    plan = plan_tools(_fields(messages=[{"role": "system", "content": "Be brief."}, *ASK], tools=[WEATHER, TIME],
                              tool_choice={"type": "function", "function": {"name": "get_time"}}), style)
    system = plan.messages[0]
    assert system["role"] == "system" and system["content"].endswith("Be brief.")
    assert "get_weather: Get the current weather" in system["content"] and '"zone"' in system["content"]
    assert "Call the tool get_time" in system["content"] and plan.tools is None
    assert plan.grammar is not None and '"get_time"' in plan.grammar.text and '"get_weather"' not in plan.grammar.text
    auto = plan_tools(_fields(tools=[WEATHER]), style)
    assert auto.messages[0]["role"] == "system" and '{"response"' in auto.messages[0]["content"]
    assert auto.grammar is not None  # calls or an answer, each its JSON object


def test_generic_history_as_text() -> None:
    out = generic_tools.calls_as_text([*ASK, {**CALLED, "content": "Checking."}, RESULT])
    assert "tool_calls" not in out[1]
    assert json.loads(out[1]["content"]) == {"response": "Checking.", "tool_calls": [
        {"name": "get_weather", "arguments": {"city": "Paris"}}]}
    assert json.loads(out[2]["content"]) == {"tool_result": {"name": "get_weather", "tool_call_id": "call_1",
                                                             "content": "Sunny, 22 C"}}


def test_decoder_keeps_the_marker_tokens_asked_for() -> None:
    tok = app_engine.engine().tokenizer
    ids = tok.encode("<|im_start|>hi<|im_end|>", add_special=False, parse_special=True)
    kept = IncrementalDecoder(tok, skip_special=True, keep=frozenset({ids[0]}))
    assert "".join(kept.add(i) for i in ids) == "<|im_start|>hi"
    assert "".join(IncrementalDecoder(tok, skip_special=True).add(i) for i in ids) == "hi"


# ---- the server, through the openai client -----------------------------------------------------------------


@pytest.fixture(scope="module")
def client(http: TestClient) -> openai.OpenAI:
    return app_engine.openai_client(http)


def ask(client: openai.OpenAI, **fields: Any) -> Any:
    body = {"model": "smollm2-135m", "messages": ASK, "tools": [WEATHER], "temperature": 0, "max_tokens": 32,
            "parallel_tool_calls": False, **fields}
    return client.chat.completions.create(**body).choices[0]


def calls_of(choice: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]


def test_props_name_the_format(http: TestClient) -> None:
    props = http.get("/props").json()
    assert props["chat_format"] == "generic" and "chat_template" in props and "total_slots" in props


def test_required_gives_a_valid_call(client: openai.OpenAI) -> None:
    choice = ask(client, tool_choice="required")
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    ((name, arguments),) = calls_of(choice)
    assert name == "get_weather" and set(arguments) == {"city"} and isinstance(arguments["city"], str)
    assert choice.message.tool_calls[0].id.startswith("call_")


def test_named_choice_calls_that_function(client: openai.OpenAI) -> None:
    choice = ask(client, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    ((name, arguments),) = calls_of(choice)
    assert name == "get_time" and set(arguments) == {"zone"} and choice.finish_reason == "tool_calls"


def test_stream_assembled_by_the_client_equals_the_answer(client: openai.OpenAI) -> None:
    body = {"model": "smollm2-135m", "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required",
            "parallel_tool_calls": False, "temperature": 0, "max_tokens": 48}
    whole = client.chat.completions.create(**body).choices[0]
    with client.chat.completions.stream(**body) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert calls_of(streamed) == calls_of(whole) and calls_of(whole)
    assert (streamed.finish_reason, streamed.message.content) == (whole.finish_reason, whole.message.content)


def test_two_turns_with_the_tool_result(client: openai.OpenAI, http: TestClient) -> None:
    first = ask(client, tool_choice="required")
    call = first.message.tool_calls[0]
    messages = [*ASK, first.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 22 C"}]
    prompt = http.post("/apply-template", json={"messages": messages, "tools": [WEATHER]}).json()["prompt"]
    assert '"name": "get_weather"' in prompt and "Sunny, 22 C" in prompt
    final = ask(client, messages=messages, tool_choice="none")
    assert final.message.content and not final.message.tool_calls


def test_choice_none_gives_content_without_tools(client: openai.OpenAI, http: TestClient) -> None:
    choice = ask(client, tool_choice="none")
    assert choice.message.content and not choice.message.tool_calls and choice.finish_reason in ("stop", "length")
    prompt = http.post("/apply-template", json={"messages": ASK, "tools": [WEATHER], "tool_choice": "none"}).json()
    assert "get_weather" not in prompt["prompt"]


def test_a_cut_call_comes_back_as_content(client: openai.OpenAI) -> None:
    choice = ask(client, tool_choice="required", max_tokens=6)
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content.startswith('{"tool_calls": [')
    with client.chat.completions.stream(model="smollm2-135m", messages=ASK, tools=[WEATHER], tool_choice="required",
                                        temperature=0, max_tokens=6) as stream:
        stream.until_done()
        streamed = stream.current_completion_snapshot.choices[0]  # (get_final_completion refuses a "length" end)
    assert streamed.message.content == choice.message.content and streamed.finish_reason == "length"


def test_auto_answers_or_calls(client: openai.OpenAI) -> None:
    choice = ask(client, max_tokens=48)
    assert choice.message.content or choice.message.tool_calls
    if choice.message.content:  # the answer's text, not its JSON
        assert not choice.message.content.lstrip().startswith("{")


def test_speculation_gives_the_same_answer(client: openai.OpenAI) -> None:
    spec = {"speculative.type": "ngram-simple", "speculative.n_max": 4, "speculative.ngram_size_n": 2}
    body = {"model": "smollm2-135m", "messages": ASK, "tools": [WEATHER], "temperature": 0, "max_tokens": 32,
            "parallel_tool_calls": False}
    for choice in ("required", "none"):
        plain = client.chat.completions.create(**body, tool_choice=choice)
        drafted = client.chat.completions.create(**body, tool_choice=choice, extra_body=spec)
        assert cast(dict, drafted.model_extra)["timings"]["draft_n_accepted"] > 0
        one, other = plain.choices[0], drafted.choices[0]
        assert calls_of(other) == calls_of(one)
        assert (other.message.content, other.finish_reason) == (one.message.content, one.finish_reason)


def test_reasoning_of_a_prompt_that_opens_thinking(client: openai.OpenAI) -> None:
    messages = [*ASK, {"role": "assistant", "content": "<think>"}]  # the answer starts inside the block
    body = {"model": "smollm2-135m", "messages": messages, "temperature": 0, "max_tokens": 8}
    thought = client.chat.completions.create(**body).choices[0].message
    reasoning = cast(dict, thought.model_extra)["reasoning_content"]
    assert reasoning and thought.content == ""  # never closed: all reasoning
    kept = client.chat.completions.create(**body, extra_body={"reasoning_format": "none"}).choices[0].message
    assert kept.content.strip().startswith(reasoning[:10]) and "reasoning_content" not in (kept.model_extra or {})
    with client.chat.completions.stream(**body) as stream:
        stream.until_done()
        streamed = stream.current_completion_snapshot.choices[0].message
    assert cast(dict, streamed.model_extra)["reasoning_content"] == reasoning and not streamed.content


@pytest.mark.parametrize(("fields", "needle"), [
    ({"tools": [{"type": "function", "function": {"name": "broken", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}]}, "tool 'broken'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
    ({"tools": [], "tool_choice": "required"}, "no tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "cannot be combined"),
    ({"reasoning_format": "r1"}, "reasoning_format"),
])
def test_bad_tool_requests_are_400(client: openai.OpenAI, fields: dict[str, Any], needle: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smollm2-135m", messages=ASK, max_tokens=2, extra_body=fields)
    assert info.value.status_code == 400 and needle in info.value.message


# ---- reasoning settings ------------------------------------------------------------------------------------


def test_reasoning_flags() -> None:
    def parsed(*flags: str) -> Any:
        return server_settings(build_parser().parse_args(["serve", "-m", "/nonexistent/model.gguf", *flags]))

    assert (parsed().reasoning_format, parsed().reasoning_budget) == ("auto", -1)
    assert parsed("--reasoning-format", "none", "--reasoning-budget", "0").reasoning_budget == 0
    with pytest.raises(SpecserveError, match="only -1 .* and 0"):
        parsed("--reasoning-budget", "512")


def test_reasoning_flags_read_llama_servers_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMA_ARG_THINK", "none")
    settings = server_settings(build_parser().parse_args(["serve", "-m", "/nonexistent/model.gguf"]))
    assert settings.reasoning_format == "none"


def test_budget_zero_turns_thinking_off_in_the_template(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = app_engine.engine()
    monkeypatch.setattr(engine.tokenizer, "chat_template", "thinking={{ enable_thinking }}")
    assert engine.render_chat(_fields()) == "thinking="  # unset: the template's own default
    monkeypatch.setattr(engine.settings, "reasoning_budget", 0)
    assert engine.render_chat(_fields()) == "thinking=False"
    assert engine.render_chat(_fields(chat_template_kwargs={"enable_thinking": True})) == "thinking=True"
