"""What the Responses and Messages APIs share on their way through the chat path.

Both are served as chat completions: a request becomes a chat completions body (messages, tools, tool_choice,
sampling) that is validated as one, so the chat template, tool plan and output readers are the chat endpoint's
own. llama-server's own options that these APIs have no name for (top_k, min_p, seed, speculative.*, ...) pass
through as they are, as on /v1/chat/completions.
"""

from __future__ import annotations

import json
from typing import Any

from specserve.server.schemas import SAMPLING_FIELDS, SPEC_FIELDS, ChatRequest, parse_body

PASSTHROUGH = frozenset({*SAMPLING_FIELDS, *SPEC_FIELDS, "cache_prompt", "reasoning_format",
                         "chat_template_kwargs", "parse_special", "n_predict", "logit_bias"})


def passthrough(extra: dict[str, Any] | None) -> dict[str, Any]:
    """The llama-server options among a request's fields its API does not declare."""
    return {key: value for key, value in (extra or {}).items() if key in PASSTHROUGH}


def chat_tool(name: str, description: str | None, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A function tool as chat completions take it."""
    function: dict[str, Any] = {"name": name, "parameters": parameters or {"type": "object", "properties": {}}}
    if description:
        function["description"] = description
    return {"type": "function", "function": function}


def named_choice(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def with_system(messages: list[dict[str, Any]], text: str | None) -> list[dict[str, Any]]:
    """`text` as the conversation's system prompt, before the text of a system message it starts with (many
    templates take one system message, first)."""
    if not text:
        return messages
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{text}\n\n{messages[0].get('content') or ''}".rstrip()}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def chat_request(body: dict[str, Any]) -> ChatRequest:
    """A chat completions body, checked as /v1/chat/completions checks its own (SpecserveError -> 400)."""
    return parse_body(ChatRequest, json.dumps(body, ensure_ascii=False).encode())
