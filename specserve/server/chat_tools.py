"""What a chat request's tools do to its prompt, its constraint and the reading of its output.

The engine learns once, from the chat template, how the model writes calls (`ToolStyle`); each request then
gets a `ToolPlan`:

- tool_choice "none" (or no tools): no tools rendered, nothing forced, the output is all content.
- "auto": the template renders the tools and the output is read for calls; unconstrained, except for the
  "generic" format, whose grammar lets the model write calls or an answer, each as its JSON object.
- "required" or a named function: as "auto", and the output is constrained to calls (call_grammar).

Earlier turns reach the template as it expects them: templates that write `arguments | tojson` get each call's
arguments as an object (parsed from the JSON string OpenAI sends); for the "generic" format they are rewritten
as text (generic_tools.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from specserve.engine.constraints import GrammarSource
from specserve.gguf.tokenizer import Tokenizer
from specserve.server import generic_tools
from specserve.server.schemas import ChatTemplateFields
from specserve.server.tool_calls import detect_format
from specserve.server.tool_grammar import call_grammar
from specserve.server.tool_scanners import HERMES_CLOSE, HERMES_OPEN, MISTRAL_ARGS, MISTRAL_CALLS, PYTHON_TAG

# The markers each format's parser reads: when the vocabulary has them as control tokens, the decoder must keep
# their text (it leaves control tokens out of answers). The first is the one a forced call opens with.
_MARKERS = {"hermes": (HERMES_OPEN, HERMES_CLOSE), "llama3": (PYTHON_TAG,), "mistral": (MISTRAL_CALLS, MISTRAL_ARGS),
            "generic": ()}
# A template that applies tojson (or items) to a call's arguments expects an object, not the JSON text.
_OBJECT_ARGUMENTS = re.compile(r"arguments\s*(?:\|\s*(?:tojson|items)|\.items\s*\()")


def _control_token(tokenizer: Tokenizer, text: str) -> int | None:
    """The id of the control token spelt `text`, if the vocabulary has one."""
    ids = tokenizer.encode(text, add_special=False, parse_special=True)
    return ids[0] if len(ids) == 1 and tokenizer.is_special(ids[0]) else None


@dataclass(frozen=True)
class ToolStyle:
    """How the served model writes tool calls, read from its chat template once at load."""

    format: str  # tool_calls.FORMATS
    object_arguments: bool = False  # the template wants a call's arguments as an object
    keep_special: frozenset[int] = frozenset()  # marker control tokens the output's text keeps
    marker_token: int | None = None  # the call opener's control token, for grammars

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> ToolStyle:
        template = tokenizer.chat_template or ""
        fmt = detect_format(template)
        markers = [_control_token(tokenizer, marker) for marker in _MARKERS[fmt]]
        return cls(fmt, bool(_OBJECT_ARGUMENTS.search(template)),
                   frozenset(token for token in markers if token is not None), markers[0] if markers else None)


@dataclass(frozen=True)
class ToolPlan:
    """One chat request's tools: what the template gets, what constrains the output, how it is read."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None  # for the template; None: no tools rendered
    grammar: GrammarSource | None = None
    parse_format: str | None = None  # the output is read for calls in this format; None: it is all content
    names: frozenset[str] = frozenset()  # the functions a call may name
    keep_special: frozenset[int] = frozenset()


def _parsed_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call  # not JSON: the template gets the text as it came
    return {**call, "function": {**function, "arguments": arguments}}


def with_object_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant messages' calls with their arguments as objects where they parse as JSON."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            message = {**message, "tool_calls": [_parsed_arguments(call) for call in calls]}
        out.append(message)
    return out


def _grammar(req: ChatTemplateFields, style: ToolStyle, choice: str | dict[str, Any]) -> GrammarSource | None:
    if choice == "auto" and style.format != "generic":
        return None  # the model may answer or call as it likes
    text = call_grammar(style.format, req.tools or [], choice, req.parallel_tool_calls,
                        marker_token=style.marker_token)
    return GrammarSource("lark", text)


def plan_tools(req: ChatTemplateFields, style: ToolStyle, own_constraint: bool = False) -> ToolPlan:
    """The request's ToolPlan. `own_constraint`: the request constrains its output itself (grammar,
    json_schema, response_format), which then wins over the tools' grammar."""
    messages = req.template_messages()
    choice = req.choice()
    active = bool(req.tools) and choice != "none"
    if style.format == "generic":
        messages = generic_tools.calls_as_text(messages)
        if active:
            text = generic_tools.instructions(req.tools or [], choice, req.parallel_tool_calls)
            messages = generic_tools.with_instructions(messages, text)
        tools = None  # described in the system message instead
    else:
        messages = with_object_arguments(messages) if style.object_arguments else messages
        tools = req.tools if active else None
    if not active:
        return ToolPlan(messages, tools)
    grammar = None if own_constraint else _grammar(req, style, choice)
    names = frozenset(tool["function"]["name"] for tool in req.tools or [])
    return ToolPlan(messages, tools, grammar, style.format, names, style.keep_special)
