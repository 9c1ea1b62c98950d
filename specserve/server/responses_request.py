"""The OpenAI Responses API's request (POST /v1/responses) and its conversation as chat messages.

A Responses request is served as a chat completion (chat_bridge.py): its input items become chat messages (a
`function_call` item joins the assistant message before it as one of its tool_calls, a `function_call_output`
becomes a tool message, a `reasoning` item the next assistant message's reasoning_content), `instructions` the
system prompt, its function tools chat tools. A stored response's output items (responses_store.py) are read back
by the same `conversation`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from specserve.errors import SpecserveError
from specserve.server.chat_bridge import chat_request, chat_tool, named_choice, passthrough, with_system
from specserve.server.schemas import ChatRequest, StrictModel

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class TextPart(StrictModel):
    """A message's text: input_text from the client, output_text of an earlier answer."""

    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]


class ReasoningPart(StrictModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(StrictModel):
    type: Literal["reasoning"]
    content: list[ReasoningPart] | None = None
    summary: list[ReasoningPart] = Field(default_factory=list)


def _item_kind(value: Any) -> str:
    """Messages may leave out their type (OpenAI's "easy" input message)."""
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return kind if isinstance(kind, str) else ""


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind)]


class FunctionTool(StrictModel):
    """A Responses function tool (flat: name and parameters beside the type); `strict` is accepted, and every
    forced call follows its schema anyway."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(StrictModel):
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    """POST /v1/responses. `reasoning` (effort, summary) is accepted and has no effect; unknown fields are
    ignored, except llama-server's own options (chat_bridge.PASSTHROUGH), which apply."""

    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    input: str | list[InputItem] = ""
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    text: TextConfig | None = None
    metadata: dict[str, Any] | None = None

    def input_items(self) -> list[dict[str, Any]]:
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}] if self.input else []
        return [item.model_dump(by_alias=True) for item in self.input]

    def _response_format(self) -> dict[str, Any] | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_ or {},
                                                       "strict": fmt.strict}}

    def _tool_choice(self) -> str | dict[str, Any] | None:
        if isinstance(self.tool_choice, FunctionChoice):
            return named_choice(self.tool_choice.name)
        return self.tool_choice

    def messages(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation as chat messages: the stored one it goes on from (`history`), then its input."""
        messages = [*history, *conversation(self.input_items())]
        if not messages:
            raise SpecserveError("input is empty: give input (and previous_response_id to go on from a response)")
        return messages

    def chat(self, messages: list[dict[str, Any]]) -> ChatRequest:
        """The chat completions request this one is, over the conversation `messages`."""
        body: dict[str, Any] = {
            **passthrough(self.model_extra), "model": self.model, "messages": with_system(messages, self.instructions),
            "parallel_tool_calls": self.parallel_tool_calls, "stream": self.stream,
            "tools": [chat_tool(t.name, t.description, t.parameters) for t in self.tools] if self.tools else None,
            "tool_choice": self._tool_choice(), "max_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "response_format": self._response_format()}
        return chat_request({key: value for key, value in body.items() if value is not None})

    def echo(self) -> dict[str, Any]:
        """The request's settings as a response object repeats them."""
        text = self.text.model_dump(by_alias=True, exclude_none=True) if self.text and self.text.format else None
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "parallel_tool_calls": self.parallel_tool_calls, "previous_response_id": self.previous_response_id,
                "reasoning": {"effort": None, "summary": None, **(self.reasoning or {})}, "store": self.store,
                "temperature": self.temperature, "top_p": self.top_p,
                "text": text or {"format": {"type": "text"}},
                "tools": [tool.model_dump(exclude_none=True) for tool in self.tools or []],
                "tool_choice": self.tool_choice.model_dump() if isinstance(self.tool_choice, FunctionChoice)
                else self.tool_choice or "auto", "metadata": self.metadata or {}}


def _text(content: Any) -> str:
    """A content's text: a string, or the text of its parts."""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content or [] if isinstance(part, dict))


def _turn(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message a call or an answer belongs to: the last message if it is an assistant turn still
    open to it, else a new one."""
    if messages and messages[-1]["role"] == "assistant":
        return messages[-1]
    messages.append({"role": "assistant", "content": None})
    return messages[-1]


def _add_message(messages: list[dict[str, Any]], item: dict[str, Any]) -> None:
    role, text = _ROLES[item["role"]], _text(item["content"])
    last = messages[-1] if messages else None
    if role == "assistant" and last is not None and last["role"] == "assistant" and not last["content"] \
            and not last.get("tool_calls"):
        last["content"] = text  # the answer after its reasoning item
        return
    messages.append({"role": role, "content": text})


def conversation(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input (or stored output) items as chat messages."""
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            _add_message(messages, item)
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            _turn(messages).setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item["output"])})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            # ("" content, not None: a template would write None as text; the answer's item fills it in)
            messages.append({"role": "assistant", "content": "", "reasoning_content": _text(parts)})
    return messages
