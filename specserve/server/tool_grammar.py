"""Forcing a tool call: `call_grammar` writes the llguidance (Lark) grammar that makes the model write a call, in
its chat template's format (tool_calls.py reads it back), for tool_choice "required" or a named function (and, for
"generic", a call or an answer for "auto"); `validate_tools` checks a request's tool definitions first.
"""

from __future__ import annotations

import json
from typing import Any

from specserve.server.tool_scanners import HERMES_CLOSE, HERMES_OPEN, MISTRAL_CALLS, check_format

# The same JSON whitespace as specserve.engine.constraints.JSON_WHITESPACE (not imported: that module loads
# torch): unlimited whitespace lets a small model pad forever instead of finishing the call.
_JSON_WHITESPACE = r"(?: |\n{1,2}[ \t]{0,20})?"
_JSON_OPTIONS = {"whitespace_pattern": _JSON_WHITESPACE, "lenient": True}
_MAX_ERROR = 300  # characters of a library error message quoted to the client


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a valid Lark string literal


def _marker(text: str, token_id: int | None) -> str:
    # A marker that is a control token in the vocabulary cannot be spelled by text tokens the way the model
    # learned it: with its id the grammar asks for that very token.
    return f"<[{token_id}]>" if token_id is not None else _lark_string(text)


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")


def _closed(schema: Any) -> Any:
    """The schema with every object that lists its properties closed to others unless it says otherwise (as
    llama.cpp's converter reads a missing additionalProperties): a forced call gets the arguments the tool
    describes, not whatever keys a small model goes on to invent."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(sub) for sub in out[key]]
    if "items" in out:
        out["items"] = _closed(out["items"])
    return out


def _call_schema(tool: dict[str, Any], arg_key: str) -> dict[str, Any]:
    """The JSON schema of one call of `tool`: its name, then its arguments."""
    function = tool["function"]
    params = _closed(function.get("parameters") or {"type": "object", "properties": {}})
    # `#/$defs/...` references resolve from the root, which is now this wrapper: the definitions move up.
    hoisted = {key: params.pop(key) for key in ("$defs", "definitions") if key in params}
    return {"x-guidance": _JSON_OPTIONS, "type": "object",
            "properties": {"name": {"const": function["name"]}, arg_key: params},
            "required": ["name", arg_key], "additionalProperties": False, **hoisted}


def _chosen_tools(tools: list[dict[str, Any]], choice: str | dict[str, Any]) -> list[dict[str, Any]]:
    if not tools:
        raise ValueError("tool_choice forces a call, but there are no tools")
    if choice == "required":
        return tools
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        chosen = [tool for tool in tools if tool["function"]["name"] == name]
        if not chosen:
            raise ValueError(f"tool_choice names function {name!r}, which is not among the tools")
        return chosen[:1]
    raise ValueError(f"tool_choice {choice!r} does not force a call")


def _calls_rule(item: str, separator: str, parallel: bool) -> str:
    return f"{item} ({_lark_string(separator)} {item})*" if parallel else item


def _framing(fmt: str, parallel: bool, marker_token: int | None) -> list[str]:
    """The Lark rules around `call_body` (one call's JSON) for a format."""
    if fmt == "hermes":
        opener = _marker(HERMES_OPEN, marker_token)
        newline = _lark_string("\n")
        return [f"start: {_calls_rule('call', chr(10), parallel)}",
                f"call: {opener} {newline} call_body {newline} {_lark_string(HERMES_CLOSE)}"]
    if fmt == "llama3":
        return [f"start: {_calls_rule('call_body', '; ', parallel)}"]
    calls = _calls_rule("call_body", ", ", parallel)
    if fmt == "mistral":
        # The array form: `[ARGS]` of the newer form is a control token too, and the parser reads both forms.
        return [f'start: {_marker(MISTRAL_CALLS, marker_token)} "[" {calls} "]"']
    opener = _lark_string('{"tool_calls": [')
    return [f'start: {opener} {calls} "]}}"']


def _answer_rules(parallel: bool) -> list[str]:
    """The generic format's calls or direct answer (`{"response": "text"}`). The shared `{` is a lexeme of its
    own: llguidance cannot choose between a literal and a %json object that begin alike."""
    calls = _calls_rule("call_body", ", ", parallel)
    return ['start: "{" (calls | response)',
            f'calls: {_lark_string(chr(34) + "tool_calls" + chr(34) + ": [")} {calls} "]}}"',
            f'response: {_lark_string(chr(34) + "response" + chr(34) + ": ")} response_text "}}"',
            'response_text: %json {"type": "string"}']


def call_grammar(fmt: str, tools: list[dict[str, Any]], choice: str | dict[str, Any], parallel: bool, *,
                 marker_token: int | None = None) -> str:
    """A grammar (llguidance's Lark) under which the model must write one call (several if `parallel`) in `fmt`.

    `choice` is "required" (any of `tools`) or `{"type": "function", "function": {"name": ...}}` (that one);
    for the "generic" format also "auto": calls or a `{"response": ...}` answer (that format's only syntax is
    the whole answer's JSON, so without a grammar a small model rarely writes either).
    `marker_token`: the token id of the format's call marker (`<tool_call>`, `[TOOL_CALLS]`) when it is a control
    token of the model's vocabulary. Tools are assumed valid (`validate_tools`)."""
    check_format(fmt)
    answer = fmt == "generic" and choice == "auto"
    chosen = _chosen_tools(tools, "required" if answer else choice)
    arg_key = "parameters" if fmt == "llama3" else "arguments"
    rules = _answer_rules(parallel) if answer else _framing(fmt, parallel, marker_token)
    rules.append("call_body: " + " | ".join(f"fn_{i}" for i in range(len(chosen))))
    rules += [f"fn_{i}: %json {json.dumps(_call_schema(tool, arg_key))}" for i, tool in enumerate(chosen)]
    return "\n".join(rules) + "\n"


def _one_line(message: str) -> str:
    text = " ".join(message.split())
    return text if len(text) <= _MAX_ERROR else text[:_MAX_ERROR - 3] + "..."


def _tool_name(tool: Any, index: int) -> str:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise ValueError(f"tool #{index}: not a function tool")
    function = tool.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool #{index}: missing function.name")
    return name


def _check_parameters(tool: dict[str, Any], name: str) -> None:
    params = tool["function"].get("parameters")
    if params is None:
        return
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise ValueError(f"tool '{name}': parameters must be a JSON schema of type \"object\"")
    import llguidance  # (here: importing this module never loads the library)

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(_call_schema(tool, "arguments"))
        error = llguidance.LLMatcher.validate_grammar(grammar)
    except ValueError as exc:
        error = str(exc)
    if error:
        raise ValueError(f"tool '{name}': invalid parameters schema: {_one_line(error)}")


def validate_tools(tools: list[dict[str, Any]]) -> None:
    """ValueError ("tool 'NAME': ...") for the first invalid tool definition of a request."""
    seen: set[str] = set()
    for index, tool in enumerate(tools):
        name = _tool_name(tool, index)
        if name in seen:
            raise ValueError(f"tool '{name}': defined twice")
        seen.add(name)
        _check_parameters(tool, name)
