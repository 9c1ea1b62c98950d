"""Tool calls read from model output (server/tool_calls.py): formats, streaming, grammars, tool checks. No model."""

from __future__ import annotations

import json
import re
from typing import Any

import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.server.tool_calls import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    ToolCall,
    ToolCallStream,
    collect,
    detect_format,
    new_call_id,
    parse,
)
from specserve.server.tool_grammar import call_grammar, validate_tools
from specserve.server.tool_scanners import FORMATS

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string"}, "days": {"type": "integer"}},
                                                 "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, NOW]
NAMES = {"get_weather", "now"}
PARIS = '{"city":"Paris"}'


def calls_of(text: str, fmt: str, names: set[str] | None = NAMES) -> tuple[str, list[tuple[str, str]]]:
    content, calls = parse(text, fmt, names)
    return content, [(call.name, call.arguments) for call in calls]


# ---- formats -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("template", "fmt"), [
    ("{% for t in tools %}<tool_call>{{ t }}</tool_call>{% endfor %}", "hermes"),
    ("<|start_header_id|>ipython<|end_header_id|> {\"name\": ..., \"parameters\": ...}", "llama3"),
    ("{{- '<|python_tag|>' + tool_call.name }}", "llama3"),
    ("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS] [TOOL_CALLS]", "mistral"),
    ("{{ bos_token }}<|im_start|>user", "generic"),
    ("", "generic"),
    (None, "generic"),
])
def test_detect_format(template: str | None, fmt: str) -> None:
    assert detect_format(template) == fmt


def test_hermes() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    assert calls_of(text, "hermes") == ("Let me check.", [("get_weather", PARIS), ("now", "{}")])


def test_hermes_leniency() -> None:
    # no closing tag at the end, arguments as a JSON string, no arguments at all
    assert calls_of('<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}', "hermes") \
        == ("", [("get_weather", PARIS)])
    assert calls_of('<tool_call>{"name": "now"}</tool_call>', "hermes") == ("", [("now", "{}")])
    assert calls_of('<tool_call>{"name":"now"}<tool_call>{"name":"now"}', "hermes") == \
        ("", [("now", "{}"), ("now", "{}")])


@pytest.mark.parametrize("bad", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>',  # bad JSON
    '<tool_call>\n{"name": "send_mail", "arguments": {}}\n</tool_call>',  # not an offered tool
    '<tool_call>\n{"name": "now", "arguments": [1]}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"name": "now", "arguments": {"x": NaN}}\n</tool_call>',  # not JSON
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut off
    "<tool_call>\n<function=now></function>\n</tool_call>",  # another syntax
])
def test_hermes_malformed_stays_content(bad: str) -> None:
    assert calls_of("Hm. " + bad, "hermes") == ("Hm. " + bad, [])


def test_hermes_malformed_next_to_good() -> None:
    good = '<tool_call>{"name": "now"}</tool_call>'
    bad = '<tool_call>{"name": "nope"}</tool_call>'
    assert calls_of(f"{bad}\n{good}\n{bad}", "hermes") == (bad + bad, [("now", "{}")])


def test_tool_names_none_accepts_any_name() -> None:
    assert calls_of('<tool_call>{"name": "send_mail"}</tool_call>', "hermes", None) == ("", [("send_mail", "{}")])


def test_llama3() -> None:
    assert calls_of('{"name": "get_weather", "parameters": {"city": "Paris"}}', "llama3") == \
        ("", [("get_weather", PARIS)])
    assert calls_of('<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}}', "llama3") == \
        ("", [("get_weather", PARIS)])
    assert calls_of(' {"type": "function", "name": "now", "parameters": {}}; {"name": "get_weather", '
                    '"parameters": {"city": "Paris"}}', "llama3") == ("", [("now", "{}"), ("get_weather", PARIS)])
    assert calls_of('Sure.<|python_tag|>{"name": "now", "parameters": {}}', "llama3") == ("Sure.", [("now", "{}")])


@pytest.mark.parametrize("text", [
    "The weather is fine.",
    '{"city": "Paris"}',  # a JSON answer, not a call
    'Call {"name": "now", "parameters": {}} maybe',  # a bare call only counts at the start
    '{"name": "now", "parameters": {}}; and then',
    '<|python_tag|>brave_search.call(query="x")',
    '{"name": "now", "parameters": {',
])
def test_llama3_content(text: str) -> None:
    content, calls = calls_of(text, "llama3")
    if text.startswith('{"name": "now", "parameters": {}};'):
        assert (content, calls) == ("; and then", [("now", "{}")])
    else:
        assert (content, calls) == (text, [])


def test_mistral() -> None:
    text = ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcdefghi"}, '
            '{"name": "now", "arguments": {}}]')
    assert calls_of(text, "mistral") == ("", [("get_weather", PARIS), ("now", "{}")])
    assert calls_of('OK [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[ARGS]{}', "mistral") == \
        ("OK", [("get_weather", PARIS), ("now", "{}")])


@pytest.mark.parametrize("text", [
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "nope", "arguments": {}}]',
    "[TOOL_CALLS]now {}",
    "[TOOL_CALLS]now[ARGS]x",
    '[TOOL_CALLS]nope[ARGS]{"a": 1}',
    "[TOOL_CALLS][]",
    "[TOOL_CALLS]",
    "[TOOL_CALL",
])
def test_mistral_malformed(text: str) -> None:
    assert calls_of(text, "mistral") == (text, [])


def test_generic() -> None:
    assert calls_of('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}', "generic") == \
        ("", [("get_weather", PARIS)])
    assert calls_of('{"tool_call": {"name": "now", "arguments": {}}}', "generic") == ("", [("now", "{}")])
    assert calls_of('{"response": "It is sunny."}', "generic") == ("It is sunny.", [])
    for text in ('{"tool_calls": [{"name": "nope", "arguments": {}}]}', '{"answer": 1}', "Plain text.",
                 '{"response": "unfinished'):
        assert calls_of(text, "generic") == (text, [])


def test_unknown_format() -> None:
    with pytest.raises(ValueError, match="tool-call format"):
        parse("x", "xml")


def test_parse_none_and_empty() -> None:
    for fmt in FORMATS:
        assert parse(None, fmt, NAMES) == ("", [])
        assert parse("", fmt, NAMES) == ("", [])


def test_tool_call_dict_and_ids() -> None:
    _, [call] = parse('<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>',
                      "hermes", NAMES)
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", call.id)
    assert call.to_openai() == {"id": call.id, "type": "function",
                                "function": {"name": "get_weather", "arguments": '{"city":"Zürich"}'}}
    assert re.fullmatch(r"[A-Za-z0-9]{9}", new_call_id("mistral"))
    _, [call] = parse('[TOOL_CALLS][{"name": "now", "arguments": {}}]', "mistral", NAMES)
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id)
    assert ToolCall("i", "n", "{}").to_openai()["function"] == {"name": "n", "arguments": "{}"}


# ---- streaming ---------------------------------------------------------------------------------------------


def test_stream_hermes_events() -> None:
    stream = ToolCallStream("hermes", NAMES)
    assert stream.feed("Let me") == [ContentDelta("Let me")]
    assert stream.feed(" check. <tool_c") == [ContentDelta(" check.")]  # a possible marker is held
    assert stream.feed('all>\n{"name": "get_weather", ') == []
    assert stream.feed('"arguments": {"city": "Paris"}}') == []  # the closing tag may follow
    events = stream.feed("\n</tool_call>")
    assert [type(e) for e in events] == [CallStart, ArgumentsDelta]
    start, args = events
    assert (start.index, start.name, args.index, args.text) == (0, "get_weather", 0, PARIS)
    assert stream.feed("\n\nDone") == [ContentDelta("Done")]  # whitespace after a call is dropped
    assert stream.finish() == []
    assert stream.finish() == []
    with pytest.raises(RuntimeError):
        stream.feed("x")


def test_stream_malformed_comes_back_as_content() -> None:
    stream = ToolCallStream("hermes", NAMES)
    assert stream.feed('<tool_call>{"name": "now", "arguments": {') == []
    assert stream.finish() == [ContentDelta('<tool_call>{"name": "now", "arguments": {')]


def test_stream_plain_json_is_not_held_to_its_end() -> None:
    stream = ToolCallStream("llama3", NAMES)
    assert stream.feed('{"ci') == [ContentDelta('{"ci')]


def test_long_call_streams_in_linear_time() -> None:
    stream = ToolCallStream("hermes", NAMES)
    assert stream.feed('<tool_call>{"name": "get_weather", "arguments": {"city": "') == []
    for _ in range(20000):
        assert stream.feed('a\\"{[') == []
    events = stream.feed('"}}</tool_call>')
    assert len(events) == 2 and json.loads(events[1].text) == {"city": 'a"{[' * 20000}


CALLS = ['{"name": "get_weather", "arguments": {"city": "Paris"}}', '{"name": "now"}', '{"name": "nope"}',
         '{"name": "now", "parameters": {"a": "}\\" ;"}}', '{"name": "now", "arguments": "{}"}', "{bad}"]
FRAGMENTS = {  # markers, pieces of them, calls, and whole well-formed calls, so that both paths come up often
    "hermes": ["<tool_call>", "</tool_call>", "<tool_c", "\n", " ", "text", "<", *CALLS,
               f"<tool_call>\n{CALLS[0]}\n</tool_call>", f"<tool_call>{CALLS[3]}"],
    "llama3": ["<|python_tag|>", "<|py", ";", " ; ", "\n", "text", "{", "}", *CALLS, f"{CALLS[1]}; {CALLS[0]}",
               f"<|python_tag|>{CALLS[3]}"],
    "mistral": ["[TOOL_CALLS]", "[ARGS]", "[AR", "now", "get_weather", "[", "]", ", ", " ", "x", "{}", *CALLS,
                f"[TOOL_CALLS][{CALLS[0]}, {CALLS[1]}]", '[TOOL_CALLS]get_weather[ARGS]{"city": "a\\"b"}'],
    "generic": ['{"tool_calls": [', '{"tool_call": ', '{"response": "hi"}', "]}", "}", ", ", " ", "x", *CALLS,
                f'{{"tool_calls": [{CALLS[0]}, {CALLS[4]}]}}', '{"response": "a\\"b"}'],
}


def _stream(deltas: list[str], fmt: str) -> tuple[str, list[tuple[str, str]]]:
    stream = ToolCallStream(fmt, NAMES)
    events = [event for delta in deltas for event in stream.feed(delta)] + stream.finish()
    assert all(e.text for e in events if isinstance(e, ContentDelta))
    starts = [e.index for e in events if isinstance(e, CallStart)]
    assert starts == list(range(len(starts)))
    content, calls = collect(events)
    return content, [(call.name, call.arguments) for call in calls]


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_split_matches_parse(fmt: str, data: st.DataObject) -> None:
    text = "".join(data.draw(st.lists(st.sampled_from(FRAGMENTS[fmt]), max_size=8)))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    bounds = sorted(set(cuts))
    deltas = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]
    expected = calls_of(text, fmt)
    assert _stream(deltas, fmt) == expected
    assert _stream(list(text), fmt) == expected  # one character at a time: every prefix is seen


# ---- grammars ----------------------------------------------------------------------------------------------


class _ByteVocabulary:
    """A tokenizer of single bytes (and an end token), enough to run a grammar over a text."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"\xff<eos>"]
    special_token_ids = [256]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


BYTES = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary()))


def accepts(grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(BYTES, llguidance.grammar_from("lark", grammar), log_level=0)
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


FORCED = {  # format -> (one call, two calls) as the grammar has the model write them
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
               '<tool_call>\n{"name":"now","arguments":{}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    "llama3": ('{"name": "get_weather", "parameters": {"city": "Paris"}}',
               '{"name": "now", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Paris"}}'),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
                '[TOOL_CALLS][{"name": "now", "arguments": {}}, {"name": "get_weather", "arguments": {"city": '
                '"Paris"}}]'),
    "generic": ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}',
                '{"tool_calls": [{"name": "now", "arguments": {}}, {"name": "get_weather", "arguments": {"city": '
                '"Paris"}}]}'),
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_grammar_forces_parseable_calls(fmt: str) -> None:
    one, two = FORCED[fmt]
    single = call_grammar(fmt, TOOLS, "required", parallel=False)
    parallel = call_grammar(fmt, TOOLS, "required", parallel=True)
    for grammar in (single, parallel):
        assert llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("lark", grammar)) == ""
    assert accepts(single, one) and accepts(parallel, one) and accepts(parallel, two)
    assert not accepts(single, two)
    assert not accepts(single, "Sure, let me check.")
    assert not accepts(single, one.replace('"Paris"', "7"))  # arguments follow the tool's schema
    assert calls_of(one, fmt) == ("", [("get_weather", PARIS)])
    assert calls_of(two, fmt) == ("", [("now", "{}"), ("get_weather", PARIS)])


def test_grammar_named_function() -> None:
    grammar = call_grammar("hermes", TOOLS, {"type": "function", "function": {"name": "now"}}, parallel=False)
    assert accepts(grammar, '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    assert not accepts(grammar, FORCED["hermes"][0])
    with pytest.raises(ValueError, match="not among the tools"):
        call_grammar("hermes", TOOLS, {"type": "function", "function": {"name": "nope"}}, parallel=False)
    with pytest.raises(ValueError, match="does not force"):
        call_grammar("hermes", TOOLS, "auto", parallel=False)
    with pytest.raises(ValueError, match="no tools"):
        call_grammar("hermes", [], "required", parallel=False)


def test_grammar_marker_token_and_defs() -> None:
    assert call_grammar("mistral", TOOLS, "required", False, marker_token=9).startswith("start: <[9]> ")
    tool = {"type": "function", "function": {"name": "move", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/point"}}, "required": ["to"],
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}}}
    validate_tools([tool])
    grammar = call_grammar("hermes", [tool], "required", False)
    assert accepts(grammar, '<tool_call>\n{"name": "move", "arguments": {"to": {"x": 1}}}\n</tool_call>')
    assert not accepts(grammar, '<tool_call>\n{"name": "move", "arguments": {"to": {"x": "a"}}}\n</tool_call>')


def test_grammar_whitespace_is_bounded() -> None:
    grammar = call_grammar("llama3", TOOLS, "required", False)
    assert not accepts(grammar, '{"name":     "now", "parameters": {}}')


def test_generic_auto_grammar_calls_or_answer() -> None:
    grammar = call_grammar("generic", TOOLS, "auto", parallel=False)
    assert llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("lark", grammar)) == ""
    assert accepts(grammar, FORCED["generic"][0]) and not accepts(grammar, FORCED["generic"][1])
    assert accepts(grammar, '{"response": "It is sunny."}')
    assert not accepts(grammar, "It is sunny.") and not accepts(grammar, '{"response": 7}')
    assert calls_of('{"response": "It is sunny."}', "generic") == ("It is sunny.", [])


def test_grammar_closes_objects_that_list_their_properties() -> None:
    one = '{{"tool_calls": [{{"name": "{}", "arguments": {}}}]}}'
    grammar = call_grammar("generic", TOOLS, "required", parallel=False)
    assert not accepts(grammar, one.format("get_weather", '{"city": "Paris", "unit": "C"}'))
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "additionalProperties": True,
        "properties": {"p": {"type": "object", "properties": {"x": {"type": "integer"}}}}}}}
    grammar = call_grammar("generic", [tool], "required", parallel=False)
    assert accepts(grammar, one.format("f", '{"p": {"x": 1}, "other": 2}'))  # open where the schema says so
    assert not accepts(grammar, one.format("f", '{"p": {"x": 1, "y": 2}}'))


# ---- tool definitions --------------------------------------------------------------------------------------


def test_validate_tools_accepts_good_tools() -> None:
    validate_tools(TOOLS)
    validate_tools([{"type": "function", "function": {"name": "x", "parameters": {}}}])
    validate_tools([])


@pytest.mark.parametrize(("tools", "message"), [
    ([{"type": "function", "function": {"description": "no name"}}], r"tool #0: missing function\.name"),
    ([NOW, {"type": "function"}], r"tool #1: missing function\.name"),
    ([{"type": "retrieval"}], "tool #0: not a function tool"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "tool 'f': parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": "city"}}], "tool 'f': parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}], "tool 'f': invalid parameters schema"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/gone"}}}}}], "tool 'f': invalid parameters schema"),
    ([NOW, NOW], "tool 'now': defined twice"),
])
def test_validate_tools_refuses(tools: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_tools(tools)
