"""Anthropic Messages API answers: a `message` whose content blocks are the answer's blocks (chat_blocks.py), or,
streamed, Anthropic's events.

Reasoning is a `thinking` block (with an empty signature: nothing here signs it), text a `text` block, a call a
`tool_use` block with its arguments as `input`. The stream is message_start, then each block's
content_block_start, deltas (text_delta, thinking_delta, input_json_delta) and content_block_stop, then
message_delta (stop_reason and the usage) and message_stop. Usage is counted as Anthropic does: input_tokens are
the prompt's tokens not read from the cache, cache_read_input_tokens those that were.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from specserve.engine.tasks import Chunk, Result, Task
from specserve.server.chat_blocks import Block, BlockEvent, BlockReader, read_blocks
from specserve.server.chat_output import OutputSpec
from specserve.server.engine import Engine
from specserve.server.errors import anthropic_error_body
from specserve.server.formats import Format


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as tool_use input (an object: the call readers only give objects)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _block(block: Block, text: str | None = None) -> dict[str, Any]:
    """The block's content block; `text` replaces its text (a block just opened has none yet)."""
    if block.kind == "call":
        return {"type": "tool_use", "id": block.call_id, "name": block.name,
                "input": _input(block.text) if text is None else {}}
    text = block.text if text is None else text
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": text, "signature": ""}
    return {"type": "text", "text": text}


def _delta(block: Block, text: str) -> dict[str, Any]:
    if block.kind == "call":
        return {"type": "input_json_delta", "partial_json": text}
    if block.kind == "reasoning":
        return {"type": "thinking_delta", "thinking": text}
    return {"type": "text_delta", "text": text}


def stop_reason(result: Result, n_calls: int) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of an answer that made n_calls calls."""
    if result.stop_type == "limit":
        return "max_tokens", None
    if n_calls:
        return "tool_use", None
    if result.stop_type == "word":
        return "stop_sequence", result.stopping_word
    return "end_turn", None


def _usage(result: Result) -> dict[str, Any]:
    return {"input_tokens": result.n_prompt - result.n_cached, "output_tokens": result.n_predicted,
            "cache_read_input_tokens": result.n_cached, "cache_creation_input_tokens": 0}


class MessagesFormat(Format):
    """POST /v1/messages (one task)."""

    named_events = True

    def __init__(self, engine: Engine, task: Task, output: OutputSpec):
        super().__init__(engine, task)
        self.id = "msg_" + secrets.token_hex(12)
        self.output = output
        self._reader = BlockReader(output)

    def error(self, status: int, message: str) -> dict[str, Any]:
        return anthropic_error_body(status, message)

    def _message(self, content: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.engine.model_name,
                "content": content, "stop_reason": None, "stop_sequence": None, "usage": usage}

    def body(self, chunks: list[Chunk], result: Result) -> dict[str, Any]:
        reader = read_blocks("".join(c.text for c in chunks), self.output)
        reason, sequence = stop_reason(result, reader.n_calls)
        message = self._message([_block(block) for block in reader.blocks], _usage(result))
        return {**message, "stop_reason": reason, "stop_sequence": sequence}

    def combine(self, bodies: list[dict[str, Any]], results: list[Result],
                formats: list[Format]) -> dict[str, Any] | list[dict[str, Any]]:
        return bodies[0]

    def start(self) -> list[dict[str, Any]]:
        # the cached share of the prompt is known at the end: message_delta's usage gives it then
        usage = {"input_tokens": len(self.task.prompt), "output_tokens": 0}
        return [{"type": "message_start", "message": self._message([], usage)}]

    def chunk(self, chunk: Chunk) -> list[dict[str, Any]]:
        return self._stream(self._reader.feed(chunk.text))

    def final(self, result: Result) -> list[dict[str, Any]]:
        events = self._stream(self._reader.finish())
        reason, sequence = stop_reason(result, self._reader.n_calls)
        return [*events, {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                          "usage": _usage(result)}, {"type": "message_stop"}]

    @staticmethod
    def _stream(events: list[BlockEvent]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in events:
            index = event.block.index
            if event.change == "opened":
                out.append({"type": "content_block_start", "index": index, "content_block": _block(event.block, "")})
            elif event.change == "grew":
                out.append({"type": "content_block_delta", "index": index, "delta": _delta(event.block, event.text)})
            else:
                assert event.change == "closed"
                out.append({"type": "content_block_stop", "index": index})
        return out
