"""OpenAI Responses API answers: a `response` object whose output items are the answer's blocks (chat_blocks.py),
or, streamed, its typed events (each with its `sequence_number`).

A reasoning block is a `reasoning` item (its text as reasoning_text content), text a `message` item with one
output_text part, a call a `function_call` item. The stream opens each item (output_item.added, and a message's or
reasoning's content_part.added), sends its deltas, and closes it (the .done events) as the block reader does; the
last event, response.completed (response.incomplete when max_output_tokens cut the answer), carries the same
response object a non-streamed request gets. The item an answer ends in is "incomplete" when it was cut.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any

from specserve.engine.tasks import Chunk, Result, Task
from specserve.server.chat_blocks import Block, BlockEvent, BlockReader, read_blocks
from specserve.server.chat_output import OutputSpec
from specserve.server.engine import Engine
from specserve.server.formats import Format

_PREFIX = {"reasoning": "rs_", "text": "msg_", "call": "fc_"}
_DELTA = {"reasoning": "response.reasoning_text.delta", "text": "response.output_text.delta",
          "call": "response.function_call_arguments.delta"}
_STREAM_ERROR_CODES = {503: "server_is_overloaded"}

# Called once the answer is complete with the response's id and its output items (to store the conversation).
OnDone = Callable[[str, list[dict[str, Any]]], None]


def _part(block: Block, text: str) -> dict[str, Any]:
    """A message's or a reasoning item's content part."""
    if block.kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponsesFormat(Format):
    """POST /v1/responses (one task: the Responses API has no `n`)."""

    named_events = True

    def __init__(self, engine: Engine, task: Task, output: OutputSpec, echo: dict[str, Any],
                 on_done: OnDone | None = None):
        super().__init__(engine, task)
        self.id = "resp_" + secrets.token_hex(24)
        self.output = output
        self.echo = echo  # the request's settings, as every response object repeats them
        self.on_done = on_done
        self._reader = BlockReader(output)
        self._ids: dict[int, str] = {}  # block index -> item id
        self._seq = 0

    # ---- the response object ----------------------------------------------------------------------------------

    def _item_id(self, block: Block) -> str:
        if block.index not in self._ids:
            self._ids[block.index] = _PREFIX[block.kind] + secrets.token_hex(24)
        return self._ids[block.index]

    def _item(self, block: Block, status: str, text: str | None = None) -> dict[str, Any]:
        """The block's item; `text` replaces its text (an item just opened has none yet)."""
        text = block.text if text is None else text
        base = {"id": self._item_id(block), "status": status}
        if block.kind == "call":
            return {**base, "type": "function_call", "call_id": block.call_id, "name": block.name, "arguments": text}
        parts = [_part(block, text)] if text else []
        if block.kind == "reasoning":
            return {**base, "type": "reasoning", "summary": [], "content": parts}
        return {**base, "type": "message", "role": "assistant", "content": parts}

    @staticmethod
    def _status(block: Block, blocks: list[Block], result: Result) -> str:
        cut = result.stop_type == "limit" and block is blocks[-1]
        return "incomplete" if cut else "completed"

    def _usage(self, result: Result, blocks: list[Block]) -> dict[str, Any]:
        reasoning = "".join(block.text for block in blocks if block.kind == "reasoning")
        # (the reasoning's tokens, re-encoded: the generated ones are not kept apart from the answer's)
        n_reasoning = len(self.engine.tokenizer.encode(reasoning, add_special=False)) if reasoning else 0
        return {"input_tokens": result.n_prompt, "input_tokens_details": {"cached_tokens": result.n_cached},
                "output_tokens": result.n_predicted,
                "output_tokens_details": {"reasoning_tokens": min(n_reasoning, result.n_predicted)},
                "total_tokens": result.n_prompt + result.n_predicted}

    def _response(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.engine.model_name, "output": output, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                **self.echo, "truncation": "disabled", "usage": None, "user": None}

    def _finished(self, blocks: list[Block], result: Result) -> dict[str, Any]:
        output = [self._item(block, self._status(block, blocks, result)) for block in blocks]
        response = self._response("incomplete" if result.stop_type == "limit" else "completed", output)
        response["usage"] = self._usage(result, blocks)
        if response["status"] == "completed":
            response["completed_at"] = int(time.time())
        if self.on_done is not None:
            self.on_done(self.id, output)
        return response

    def body(self, chunks: list[Chunk], result: Result) -> dict[str, Any]:
        reader = read_blocks("".join(c.text for c in chunks), self.output)
        return self._finished(reader.blocks, result)

    def combine(self, bodies: list[dict[str, Any]], results: list[Result],
                formats: list[Format]) -> dict[str, Any] | list[dict[str, Any]]:
        return bodies[0]

    # ---- the stream -------------------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        response = self._response("in_progress", [])
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def chunk(self, chunk: Chunk) -> list[dict[str, Any]]:
        return self._stream(self._reader.feed(chunk.text), None)

    def final(self, result: Result) -> list[dict[str, Any]]:
        events = self._stream(self._reader.finish(), result)
        response = self._finished(self._reader.blocks, result)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return [*events, self._event(kind, response=response)]

    def stream_error(self, status: int, message: str) -> dict[str, Any]:
        return self._event("error", code=_STREAM_ERROR_CODES.get(status, "server_error"), message=message, param=None)

    def _stream(self, events: list[BlockEvent], result: Result | None) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in events:
            if event.change == "opened":
                out += self._opened(event.block)
            elif event.change == "grew":
                out.append(self._grew(event.block, event.text))
            else:
                assert event.change == "closed"
                # a block closed before the end has a block after it: complete; the last one may be cut
                status = "completed" if result is None else self._status(event.block, self._reader.blocks, result)
                out += self._closed(event.block, status)
        return out

    def _where(self, block: Block) -> dict[str, Any]:
        return {"item_id": self._item_id(block), "output_index": block.index}

    def _opened(self, block: Block) -> list[dict[str, Any]]:
        added = self._event("response.output_item.added", output_index=block.index,
                            item=self._item(block, "in_progress", ""))
        if block.kind == "call":
            return [added]
        return [added, self._event("response.content_part.added", **self._where(block), content_index=0,
                                   part=_part(block, ""))]

    def _grew(self, block: Block, text: str) -> dict[str, Any]:
        fields: dict[str, Any] = {} if block.kind == "call" else {"content_index": 0}
        if block.kind == "text":
            fields["logprobs"] = []
        return self._event(_DELTA[block.kind], **self._where(block), **fields, delta=text)

    def _closed(self, block: Block, status: str) -> list[dict[str, Any]]:
        if block.kind == "call":
            events = [self._event("response.function_call_arguments.done", **self._where(block), name=block.name,
                                  arguments=block.text)]
        else:
            text_done = "response.reasoning_text.done" if block.kind == "reasoning" else "response.output_text.done"
            extra: dict[str, Any] = {"logprobs": []} if block.kind == "text" else {}
            events = [self._event(text_done, **self._where(block), content_index=0, text=block.text, **extra),
                      self._event("response.content_part.done", **self._where(block), content_index=0,
                                  part=_part(block, block.text))]
        return [*events, self._event("response.output_item.done", output_index=block.index,
                                     item=self._item(block, status))]
