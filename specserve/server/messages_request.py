"""The Anthropic Messages API's request (POST /v1/messages, /v1/messages/count_tokens) as chat messages.

A Messages request is served as a chat completion (chat_bridge.py): `system` becomes the system message, an
assistant's text and tool_use blocks one assistant message with its tool_calls (thinking blocks its
reasoning_content), a user's tool_result blocks tool messages and its text a user message, each in the order
given; tools become function tools, tool_choice auto/any/tool/none the chat's auto/required/named/none, and
`thinking` the template's enable_thinking.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specserve.server.chat_bridge import chat_request, chat_tool, named_choice, passthrough, with_system
from specserve.server.schemas import ChatRequest, StrictModel


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False


class ThinkingBlock(StrictModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(StrictModel):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                         Field(discriminator="type")]


class Message(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(StrictModel):
    """A client tool; Anthropic's server tools (web search, code execution, ...) are not served."""

    type: Literal["custom"] | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _tool_is_named(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice of type tool needs the tool's name")
        return self


class Thinking(StrictModel):
    """enabled: the chat template renders with thinking on; disabled: off; adaptive (and between_tools): as the
    template does by default. budget_tokens and display are accepted and have no effect."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None


class OutputFormat(StrictModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(StrictModel):
    """`format` constrains the answer to its JSON schema; `effort` is accepted and has no effect."""

    effort: str | None = None
    format: OutputFormat | None = None


class CountTokensRequest(BaseModel):
    """POST /v1/messages/count_tokens: what makes the prompt. Unknown fields are ignored, except llama-server's
    own options (chat_bridge.PASSTHROUGH), which apply."""

    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    system: str | list[TextBlock] | None = None
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    def _template_kwargs(self) -> dict[str, Any] | None:
        kwargs = dict(passthrough(self.model_extra).get("chat_template_kwargs") or {})
        if self.thinking is not None and self.thinking.type in ("enabled", "disabled"):
            kwargs["enable_thinking"] = self.thinking.type == "enabled"
        return kwargs or None

    def _tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if choice is None:
            return None
        if choice.type == "tool":
            return named_choice(choice.name or "")
        return {"auto": "auto", "any": "required", "none": "none"}[choice.type]

    def chat_body(self) -> dict[str, Any]:
        """The chat completions body of this request (values None left out)."""
        system = self.system if isinstance(self.system, str) else _joined(self.system or [])
        body = {**passthrough(self.model_extra), "model": self.model,
                "messages": with_system(conversation(self.messages), system),
                "tools": [chat_tool(t.name, t.description, t.input_schema) for t in self.tools] if self.tools else None,
                "tool_choice": self._tool_choice(), "chat_template_kwargs": self._template_kwargs()}
        if self.tool_choice is not None and self.tool_choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
        return {key: value for key, value in body.items() if value is not None}

    def chat(self) -> ChatRequest:
        return chat_request(self.chat_body())


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None

    def _response_format(self) -> dict[str, Any] | None:
        fmt = self.output_config.format if self.output_config is not None else None
        if fmt is None:
            return None
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}

    def chat_body(self) -> dict[str, Any]:
        body = {**super().chat_body(), "max_tokens": self.max_tokens, "stream": self.stream,
                "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "stop": self.stop_sequences or None, "response_format": self._response_format()}
        return {key: value for key, value in body.items() if value is not None}


def _joined(blocks: list[TextBlock]) -> str:
    """Text blocks as one text: apart, as they were given (an agent's reminder block, then the prompt's)."""
    return "\n\n".join(block.text for block in blocks)


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else _joined(content)


def _assistant(blocks: list[Any]) -> dict[str, Any]:
    text = _joined([block for block in blocks if isinstance(block, TextBlock)])
    calls = [{"id": block.id, "type": "function",
              "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}}
             for block in blocks if isinstance(block, ToolUseBlock)]
    thinking = "".join(block.thinking for block in blocks if isinstance(block, ThinkingBlock))
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = thinking
    return message


def _user(blocks: list[Any]) -> list[dict[str, Any]]:
    """Tool results as tool messages and text as user messages, in their order."""
    out: list[dict[str, Any]] = []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            text = _text(block.content)
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": f"Error: {text}" if block.is_error else text})
        elif isinstance(block, TextBlock):
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += "\n\n" + block.text
            else:
                out.append({"role": "user", "content": block.text})
    return out


def conversation(messages: list[Message]) -> list[dict[str, Any]]:
    """The messages as chat messages."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
        elif message.role == "assistant":
            out.append(_assistant(message.content))
        else:
            out += _user(message.content)
    return out
