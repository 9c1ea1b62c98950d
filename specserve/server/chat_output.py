"""A chat answer's text as OpenAI message parts: reasoning first, then content and tool calls.

The generated text goes through the reasoning splitter (reasoning.py); what it gives as content goes through
the tool-call reader (tool_calls.py) when the request's tools are active. `ChatOutput` does this delta by
delta for a stream, `read_message` for a whole answer; both run the same readers, so a streamed answer put
together is the non-streamed one (call ids apart: each answer draws its own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specserve.server.reasoning import ReasoningStream
from specserve.server.tool_calls import ArgumentsDelta, CallStart, ContentDelta, ToolCall, ToolCallStream, collect


@dataclass(frozen=True)
class OutputSpec:
    """How one chat task's text is read."""

    reasoning_format: str = "auto"  # reasoning.FORMATS
    started_open: bool = False  # the prompt opened the reasoning block (reasoning.prompt_opens_thinking)
    tool_format: str | None = None  # read calls in this format (tool_calls.FORMATS); None: no tools
    tool_names: frozenset[str] = frozenset()  # the functions a call may name


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


Piece = ReasoningDelta | ContentDelta | CallStart | ArgumentsDelta


class ChatOutput:
    """Reads one answer as it is generated: `feed` each piece of text, then `finish`."""

    def __init__(self, spec: OutputSpec):
        self._reasoning = ReasoningStream(spec.reasoning_format, spec.started_open)
        self._tools = ToolCallStream(spec.tool_format, set(spec.tool_names)) if spec.tool_format else None
        self.n_calls = 0

    def feed(self, text: str) -> list[Piece]:
        return self._route(self._reasoning.feed(text)) if text else []

    def finish(self) -> list[Piece]:
        """The answer ended: what the readers hold comes out now."""
        pieces = self._route(self._reasoning.finish())
        if self._tools is not None:
            pieces += self._counted(self._tools.finish())
        return pieces

    def _route(self, parts: list[tuple[str, str]]) -> list[Piece]:
        pieces: list[Piece] = []
        for kind, text in parts:
            if kind == "reasoning":
                pieces.append(ReasoningDelta(text))
            elif self._tools is None:
                pieces.append(ContentDelta(text))
            else:
                pieces += self._counted(self._tools.feed(text))
        return pieces

    def _counted(self, events: list[Any]) -> list[Piece]:
        self.n_calls += sum(isinstance(event, CallStart) for event in events)
        return events


@dataclass(frozen=True)
class Message:
    reasoning: str | None
    content: str
    calls: list[ToolCall]


def read_message(text: str, spec: OutputSpec) -> Message:
    """The parts of a whole answer."""
    output = ChatOutput(spec)
    pieces = output.feed(text) + output.finish()
    reasoning = "".join(p.text for p in pieces if isinstance(p, ReasoningDelta))
    content, calls = collect(p for p in pieces if not isinstance(p, ReasoningDelta))
    return Message(reasoning or None, content, calls)


def finish_reason(reason: str, n_calls: int) -> str:
    """The finish reason of an answer that stopped for `reason` ("stop", "length") after n_calls calls:
    "tool_calls" when it made calls, unless it was cut by the length limit (then "length": a call cut short is
    given back as content, and the client should know the answer is incomplete)."""
    return "tool_calls" if n_calls and reason != "length" else reason


def message_json(message: Message) -> dict[str, Any]:
    """The OpenAI `message` of a non-streamed choice (content null when there are only calls, as OpenAI)."""
    out: dict[str, Any] = {"role": "assistant",
                           "content": message.content if message.content or not message.calls else None}
    if message.reasoning is not None:
        out["reasoning_content"] = message.reasoning
    if message.calls:
        out["tool_calls"] = [call.to_openai() for call in message.calls]
    return out


def delta_json(piece: Piece) -> dict[str, Any]:
    """A streamed chunk's `delta` for one piece: a call starts with its id and name, its arguments follow."""
    if isinstance(piece, ReasoningDelta):
        return {"reasoning_content": piece.text}
    if isinstance(piece, ContentDelta):
        return {"content": piece.text}
    if isinstance(piece, CallStart):
        return {"tool_calls": [{"index": piece.index, "id": piece.id, "type": "function",
                                "function": {"name": piece.name, "arguments": ""}}]}
    return {"tool_calls": [{"index": piece.index, "function": {"arguments": piece.text}}]}
