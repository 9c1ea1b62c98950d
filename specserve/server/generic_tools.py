"""Tools for a chat template that has no tool syntax of its own (the "generic" format of tool_calls.py).

The model is told about the tools in a system message and answers with one JSON object: `{"tool_calls": [...]}`
to call tools, `{"response": "..."}` to answer (the request's grammar holds it to that). Earlier turns of the
conversation are put in the same terms: an assistant message's calls become the JSON it would have written, a
tool's result a JSON object naming the call it answers, so that any template, even one that only knows `role`
and `content`, renders them.
"""

from __future__ import annotations

import json
from typing import Any

_INTRO = ("You can use tools. Each tool below is given as its name, what it does, and the JSON schema of its "
          "arguments.")
_CALL_FORM = '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]}'
_ONE_CALL_FORM = '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]} (one call only)'
_RESPONSE_FORM = '{"response": "<your answer>"}'


def _tool_line(tool: dict[str, Any]) -> str:
    function = tool["function"]
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    description = function.get("description") or "(no description)"
    return f"- {function['name']}: {description}\n  arguments: {json.dumps(parameters, ensure_ascii=False)}"


def _rules(choice: str | dict[str, Any], parallel: bool) -> str:
    calls = _CALL_FORM if parallel else _ONE_CALL_FORM
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        return f"Call the tool {name} now. Reply with this JSON object and nothing else:\n{calls}"
    if choice == "required":
        return f"Call one of the tools now. Reply with this JSON object and nothing else:\n{calls}"
    return ("Reply with one JSON object and nothing else. To call tools:\n"
            f"{calls}\nTo answer the user yourself (also once a tool_result gives what you need):\n{_RESPONSE_FORM}")


def instructions(tools: list[dict[str, Any]], choice: str | dict[str, Any], parallel: bool) -> str:
    """The system text that teaches the tools and the answer's JSON form (`choice`: auto, required or named)."""
    lines = "\n".join(_tool_line(tool) for tool in tools)
    return f"{_INTRO}\n\n{lines}\n\n{_rules(choice, parallel)}"


def with_instructions(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """`text` as the first system message, or before the text of the one the conversation has."""
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = f"{text}\n\n{first.get('content') or ''}".rstrip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _arguments(value: Any) -> Any:
    """A call's arguments as an object where its JSON text allows (the form the model writes them in)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _call_object(call: Any) -> dict[str, Any]:
    function = call.get("function", call) if isinstance(call, dict) else {}
    return {"name": function.get("name"), "arguments": _arguments(function.get("arguments", {}))}


def _call_names(messages: list[dict[str, Any]]) -> dict[str, str]:
    """Tool call id -> function name, over the conversation's assistant messages."""
    names: dict[str, str] = {}
    for message in messages:
        for call in message.get("tool_calls") or []:
            if isinstance(call, dict) and isinstance(call.get("id"), str):
                names[call["id"]] = _call_object(call)["name"]
    return names


def _assistant_text(message: dict[str, Any]) -> dict[str, Any]:
    answer: dict[str, Any] = {"tool_calls": [_call_object(call) for call in message["tool_calls"]]}
    if message.get("content"):
        answer = {"response": message["content"], **answer}
    out = {key: value for key, value in message.items() if key != "tool_calls"}
    out["content"] = json.dumps(answer, ensure_ascii=False)
    return out


def _tool_text(message: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    call_id = message.get("tool_call_id")
    result: dict[str, Any] = {"name": message.get("name") or names.get(call_id or ""), "tool_call_id": call_id,
                              "content": message.get("content") or ""}
    return {**message, "content": json.dumps({"tool_result": result}, ensure_ascii=False)}


def calls_as_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with earlier calls and tool results written as plain message text."""
    names = _call_names(messages)
    out = []
    for message in messages:
        if message.get("role") == "assistant" and message.get("tool_calls"):
            message = _assistant_text(message)
        elif message.get("role") == "tool":
            message = _tool_text(message, names)
        out.append(message)
    return out
