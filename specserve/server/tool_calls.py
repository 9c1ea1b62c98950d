"""Tool calls in a model's output: the text a chat template taught the model to write, read as OpenAI tool calls.

Four output formats, chosen from the chat template's text by `detect_format`:

- "hermes" (Qwen2.5, Qwen3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block
  per call, anywhere in the text (content may precede them).
- "llama3" (Llama 3.x custom tools): a JSON object `{"name": ..., "parameters": {...}}` at the start of the output
  or after `<|python_tag|>`; further calls follow after `;`.
- "mistral": `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer `[TOOL_CALLS]name[ARGS]{...}`.
- "generic" (templates without a tool syntax): the whole answer is JSON, `{"tool_calls": [...]}` (or a single
  `{"tool_call": {...}}`) or `{"response": "text"}`.

`parse` reads a finished output, `ToolCallStream` reads one as it is generated; both run the same scanner
(tool_scanners.py), whose decisions never depend on text not seen yet, so every way of cutting a text into deltas
gives the same calls and content as `parse` of the whole text. A call that turns out malformed (bad JSON, a tool
the request did not offer) is not an error: its text stays in the content, so the client gets back what the model
wrote.

The special tokens `<|python_tag|>` and `[TOOL_CALLS]` are only seen if the output is decoded with special
tokens kept. Forcing a call with a grammar, and checking a request's tool definitions, is tool_grammar.py's.
"""

from __future__ import annotations

import secrets
import string
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from specserve.server.held_text import Trimmed
from specserve.server.tool_scanners import (
    FORMATS,
    HERMES_CLOSE,
    HERMES_OPEN,
    MISTRAL_CALLS,
    PYTHON_TAG,
    SCANNERS,
    Piece,
    TextPiece,
    check_format,
)

__all__ = ["FORMATS", "HERMES_CLOSE", "HERMES_OPEN", "MISTRAL_CALLS", "ArgumentsDelta", "CallStart", "ContentDelta",
           "Event", "ToolCall", "ToolCallStream", "check_format", "collect", "detect_format", "new_call_id", "parse"]

_ID_CHARS = string.ascii_letters + string.digits




@dataclass(frozen=True)
class ToolCall:
    """One call; `arguments` is a compact JSON object text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """The call as an OpenAI chat message's `tool_calls` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ContentDelta:
    """Text outside any call."""

    text: str


@dataclass(frozen=True)
class CallStart:
    """Call number `index` (from 0) begins; its arguments follow as ArgumentsDelta events."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    """A piece of call `index`'s arguments text."""

    index: int
    text: str


Event = ContentDelta | CallStart | ArgumentsDelta


def new_call_id(fmt: str = "hermes") -> str:
    """A fresh call id: `call_` and 24 letters/digits; 9 letters/digits for Mistral, whose chat templates refuse
    any other id when the call comes back in the conversation."""
    if fmt == "mistral":
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


def detect_format(chat_template: str | None) -> str:
    """The tool-call format a chat template teaches, from its text; "generic" when it shows none."""
    text = chat_template or ""
    if MISTRAL_CALLS in text:
        return "mistral"
    if HERMES_OPEN in text:
        return "hermes"
    llama_headers = "ipython" in text or "<|start_header_id|>" in text
    if PYTHON_TAG in text or ('"parameters"' in text and llama_headers):
        return "llama3"
    return "generic"


# ---- parsing and streaming ---------------------------------------------------------------------------------


class ToolCallStream:
    """Reads an output delta by delta. Content comes out as soon as it cannot be the start of a call marker;
    whitespace next to a call is dropped, so content's trailing whitespace waits to see what follows. A call is
    held until it is complete and valid (then CallStart and its whole compact arguments), or turns out malformed
    (then its text comes out as content)."""

    def __init__(self, fmt: str, tool_names: set[str] | None = None):
        check_format(fmt)
        self._fmt = fmt
        self._scanner = SCANNERS[fmt](tool_names)
        self._buf = ""
        self._text = Trimmed(lead=False)  # whitespace next to a call is dropped
        self._calls = 0
        self._finished = False

    def feed(self, delta: str) -> list[Event]:
        if self._finished:
            raise RuntimeError("ToolCallStream.feed after finish")
        self._buf += delta
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        """The output ended: whatever is held is decided now."""
        if self._finished:
            return []
        events = self._drain(final=True)
        if self._text.held:
            events.append(ContentDelta(self._text.held))
            self._text.boundary()
        self._finished = True
        return events

    def _drain(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while self._buf:
            step = self._scanner.step(self._buf, final)
            if step is None:
                break
            used, pieces = step
            self._scanner.consumed()
            self._buf = self._buf[used:]
            for piece in pieces:
                events.extend(self._emit(piece))
        return events

    def _emit(self, piece: Piece) -> list[Event]:
        if isinstance(piece, TextPiece):
            return self._content(piece.text)
        self._text.boundary()
        index = self._calls
        self._calls += 1
        return [CallStart(index, new_call_id(self._fmt), piece.name), ArgumentsDelta(index, piece.arguments)]

    def _content(self, text: str) -> list[Event]:
        body = self._text.add(text)
        return [ContentDelta(body)] if body else []


def collect(events: Iterable[Event]) -> tuple[str, list[ToolCall]]:
    """Content and calls put together from a stream's events."""
    content: list[str] = []
    starts: dict[int, CallStart] = {}
    arguments: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, ContentDelta):
            content.append(event.text)
        elif isinstance(event, CallStart):
            starts[event.index] = event
            arguments[event.index] = []
        else:
            arguments[event.index].append(event.text)
    calls = [ToolCall(starts[i].id, starts[i].name, "".join(arguments[i])) for i in sorted(starts)]
    return "".join(content), calls


def parse(text: str | None, fmt: str, tool_names: set[str] | None = None) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a finished output. Content is the text outside the calls, markers removed and the
    whitespace next to calls dropped; a malformed call's text stays in it."""
    stream = ToolCallStream(fmt, tool_names)
    return collect(stream.feed(text or "") + stream.finish())
