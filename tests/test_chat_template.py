"""Chat templates: the GGUF templates render exactly as HF renders them; lenient undefined semantics."""

from __future__ import annotations

import datetime
from functools import cache
from types import SimpleNamespace
from typing import Any

import pytest

from specserve import catalog
from specserve.errors import SpecserveError
from specserve.gguf import chat_template as ct
from specserve.gguf.chat_template import apply_chat_template, render_chat
from specserve.gguf.reader import GGUFFile
from specserve.gguf.tokenizer import Tokenizer

SYSTEM = {"role": "system", "content": "You are terse. Réponds en français si on te parle français."}
USER1 = {"role": "user", "content": "What is 2 + 2?"}
ASSISTANT1 = {"role": "assistant", "content": "4."}
USER2 = {"role": "user", "content": "Et en chiffres romains ? 日本語でも 🙂\n\twith a tab"}

CONVERSATIONS = [
    [USER1],
    [SYSTEM, USER1],
    [SYSTEM, USER1, ASSISTANT1, USER2],
    [USER1, ASSISTANT1, USER2, {"role": "assistant", "content": "IV / 四"}],
    [{"role": "user", "content": ""}],
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Météo actuelle d'une ville <b>now</b>",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City, e.g. 東京"}},
                "required": ["city"],
            },
        },
    }
]
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Tokyo?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "東京"}}}],
    },
    {"role": "tool", "content": '{"temp_c": 21}'},
    {"role": "tool", "content": '{"humidity": 0.4}'},
    {"role": "assistant", "content": "21 °C."},
    {"role": "user", "content": "Thanks"},
]


@cache
def load(name: str) -> tuple[Tokenizer, Any]:
    from transformers import AutoTokenizer

    path = catalog.pull(name)
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return Tokenizer.from_gguf(GGUFFile(path)), hf


def check_matches_hf(tok: Tokenizer, hf: Any, tools: bool) -> None:
    assert tok.chat_template == hf.chat_template
    for messages in CONVERSATIONS:
        for gen in (True, False):
            ours = apply_chat_template(tok, messages, add_generation_prompt=gen)
            theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours == theirs, (messages, gen)
    # the default asks for the assistant's turn, as the server needs
    assert apply_chat_template(tok, [USER1]) == hf.apply_chat_template(
        [USER1], tokenize=False, add_generation_prompt=True
    )
    if tools:
        for messages in ([USER1], TOOL_CONVERSATION, [SYSTEM, *TOOL_CONVERSATION]):
            ours = apply_chat_template(tok, messages, tools=TOOLS)
            theirs = hf.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
            assert ours == theirs, messages


def test_smollm_template_matches_hf() -> None:
    tok, hf = load("smollm2-135m")
    check_matches_hf(tok, hf, tools=False)
    text = apply_chat_template(tok, [USER1])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_qwen_template_matches_hf(name: str) -> None:
    tok, hf = load(name)
    check_matches_hf(tok, hf, tools=True)
    text = apply_chat_template(tok, TOOL_CONVERSATION, tools=TOOLS)
    assert '"東京"' in text and "<tool_response>" in text  # tojson keeps non-ASCII


# -- lenient undefined values (the seed's test-jinja.cpp cases, as a table) -----------------

UNDEFINED_CASES = [
    ("for over undefined runs else", "{% for v in missing %}{{ v }}{% else %}nothing{% endfor %}", "nothing"),
    ("undefined is a sequence", "{{ 'seq' if missing is sequence }}", "seq"),
    ("undefined is iterable", "{{ 'iter' if missing is iterable }}", "iter"),
    ("capitalize", "[{{ missing|capitalize }}]", "[]"),
    ("title", "[{{ missing|title }}]", "[]"),
    ("truncate", "[{{ missing|truncate(5) }}]", "[]"),
    ("upper", "[{{ missing|upper }}]", "[]"),
    ("lower", "[{{ missing|lower }}]", "[]"),
    ("replace", "[{{ missing|replace('x', 'y') }}]", "[]"),
    ("trim", "[{{ missing|trim }}]", "[]"),
    ("wordcount", "{{ missing|wordcount }}", "0"),
    ("select", "[{% for v in missing|select('even') %}{{ v }}{% endfor %}]", "[]"),
    ("selectattr", "[{% for v in missing|selectattr('on') %}{{ v.id }}{% endfor %}]", "[]"),
    ("reject", "[{% for v in missing|reject('odd') %}{{ v }}{% endfor %}]", "[]"),
    ("rejectattr", "[{% for v in missing|rejectattr('on') %}{{ v.id }}{% endfor %}]", "[]"),
    ("list", "{{ missing|list|string }}", "[]"),
    ("string", "[{{ missing|string }}]", "[]"),
    ("first", "[{{ missing|first }}]", "[]"),
    ("last", "[{{ missing|last }}]", "[]"),
    ("length", "{{ missing|length }}", "0"),
    ("join", "[{{ missing|join(', ') }}]", "[]"),
    ("sort", "{{ missing|sort|string }}", "[]"),
    ("reverse", "[{{ missing|reverse|join }}]", "[]"),
    ("map", "[{% for v in missing|map(attribute='name') %}{{ v }}{% endfor %}]", "[]"),
    ("min", "[{{ missing|min }}]", "[]"),
    ("max", "[{{ missing|max }}]", "[]"),
    ("unique", "[{{ missing|unique|join }}]", "[]"),
    ("sum", "{{ missing|sum }}", "0"),
    ("items", "[{{ missing|items|join }}]", "[]"),
    ("safe", "[{{ missing|safe }}]", "[]"),
    ("none is safe as text", "{{ none|safe }}", "None"),
    ("field of undefined", "[{{ missing.tool_calls[0].name }}]", "[]"),
    ("field of undefined is not defined", "{{ 'no' if missing.x is not defined }}", "no"),
    ("default", "{{ missing|default('fallback') }}", "fallback"),
]


@pytest.mark.parametrize(("name", "source", "expected"), UNDEFINED_CASES, ids=[c[0] for c in UNDEFINED_CASES])
def test_undefined_is_lenient(name: str, source: str, expected: str) -> None:
    assert render_chat(source, []) == expected


def test_defined_values_keep_normal_semantics() -> None:
    src = "{{ xs|sort|join(',') }} {{ xs|length }} {{ xs|sum }} {{ xs|first }} {{ xs|max }} {{ 'ab'|upper }}"
    assert render_chat(src, [], xs=[3, 1, 2]) == "1,2,3 3 6 3 3 AB"
    assert render_chat("{% for v in xs %}{{ v }}{% else %}empty{% endfor %}", [], xs=[]) == "empty"


# -- what HF templates rely on -------------------------------------------------------------


def test_template_variables() -> None:
    src = "{{ bos_token }}{% for m in messages %}{{ m.role }}:{{ m['content'] }};{% endfor %}"
    src += "{% if add_generation_prompt %}go{% endif %}{{ eos_token }}{{ tools is none }}"
    out = render_chat(src, [USER1, ASSISTANT1], bos_token="<s>", eos_token="</s>")
    assert out == "<s>user:What is 2 + 2?;assistant:4.;go</s>True"
    assert render_chat(src, [], add_generation_prompt=False) == "True"
    assert render_chat("{{ custom }}|{{ tools|length }}", [], custom="x", tools=[{}]) == "x|1"


def test_trim_and_lstrip_blocks() -> None:
    src = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}\n"
    assert render_chat(src, [USER1, ASSISTANT1]) == "[What is 2 + 2?]\n"


def test_loop_controls_and_loop_object() -> None:
    src = (
        "{% for x in xs %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 5 %}{% break %}{% endif %}"
        "{{ loop.index0 }}{{ x }}{{ '|' if not loop.last }}{% endfor %}"
    )
    assert render_chat(src, [], xs=[1, 2, 3, 4, 5, 6]) == "01|23|34|"
    ns = "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}"
    assert render_chat(ns, [USER1, ASSISTANT1, USER2]) == "3"


def test_tojson_like_hf() -> None:
    value = {"b": "東京 <tag> & 'q'", "a": [1, None, True]}
    assert render_chat("{{ v|tojson }}", [], v=value) == '{"b": "東京 <tag> & \'q\'", "a": [1, null, true]}'
    assert render_chat("{{ v|tojson(indent=2) }}", [], v={"k": 1}) == '{\n  "k": 1\n}'
    assert render_chat("{{ v|tojson(sort_keys=true) }}", [], v={"b": 1, "a": 2}) == '{"a": 2, "b": 1}'
    assert render_chat("{{ missing|tojson }}", []) == "null"


def test_raise_exception_and_strftime_now() -> None:
    src = "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}"
    with pytest.raises(SpecserveError, match="first message must be from the user"):
        render_chat(src, [ASSISTANT1])
    assert render_chat(src, [USER1]) == ""
    year = render_chat("{{ strftime_now('%Y') }}", [])
    assert year in {str(datetime.date.today().year), str(datetime.date.today().year + 1)}


# -- errors, sandbox, cache ------------------------------------------------------------------


def test_syntax_error_is_clear() -> None:
    with pytest.raises(SpecserveError, match="syntax error at line 2"):
        render_chat("ok\n{% if messages %}unclosed", [USER1])


def test_render_errors_are_clear() -> None:
    # Qwen-style template concatenating a None content: the conversation does not fit the template
    with pytest.raises(SpecserveError, match="chat template"):
        render_chat("{{ 'x' + messages[0].content }}", [{"role": "user", "content": None}])
    with pytest.raises(SpecserveError, match="list of objects"):
        render_chat("{{ messages }}", ["hello"])  # type: ignore[list-item]
    with pytest.raises(SpecserveError, match="empty"):
        render_chat("", [USER1])


def test_sandbox_blocks_mutation_and_internals() -> None:
    with pytest.raises(SpecserveError):
        render_chat("{{ messages.append(1) }}", [USER1])
    out = render_chat("{{ ''.__class__.__mro__ }}{{ messages.__class__ }}", [USER1])
    assert "class" not in out


def test_templates_are_compiled_once() -> None:
    src = "{{ messages|length }} unique-template-for-cache-test"
    render_chat(src, [USER1])
    hits = ct._compile.cache_info().hits
    assert render_chat(src, [USER1, USER2]) == "2 unique-template-for-cache-test"
    assert ct._compile.cache_info().hits == hits + 1


def test_model_without_template() -> None:
    tok = SimpleNamespace(chat_template=None, bos_id=None, eos_id=None)
    with pytest.raises(SpecserveError, match="no chat template"):
        apply_chat_template(tok, [USER1])  # type: ignore[arg-type]
