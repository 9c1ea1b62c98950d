"""A chat answer as a sequence of blocks: reasoning, text and calls, in the order the model wrote them.

The Responses API sends an answer as output items, the Messages API as content blocks: both are this sequence,
each block opened, grown and closed in turn. `BlockReader` turns the pieces of `ChatOutput` (chat_output.py) into
these events, so a stream and a whole answer (the same reader over the whole text) give the same blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from specserve.server.chat_output import ChatOutput, OutputSpec, Piece, ReasoningDelta
from specserve.server.tool_calls import ArgumentsDelta, CallStart, ContentDelta


@dataclass
class Block:
    kind: str  # "reasoning", "text" or "call"
    index: int  # its place in the answer, from 0
    text: str = ""  # the reasoning or the text; a call's arguments (JSON)
    call_id: str = ""
    name: str = ""


@dataclass(frozen=True)
class BlockEvent:
    """A block was "opened", "grew" by `text`, or was "closed"."""

    change: Literal["opened", "grew", "closed"]
    block: Block
    text: str = ""


class BlockReader:
    """Reads one answer into blocks: `feed` each piece of text, then `finish`. One block is open at a time; a
    piece of another kind closes it and opens the next."""

    def __init__(self, spec: OutputSpec):
        self._output = ChatOutput(spec)
        self.blocks: list[Block] = []
        self._open: Block | None = None
        self._calls: dict[int, Block] = {}  # the call reader's index -> its block

    @property
    def n_calls(self) -> int:
        return self._output.n_calls

    def feed(self, text: str) -> list[BlockEvent]:
        return self._events(self._output.feed(text))

    def finish(self) -> list[BlockEvent]:
        """The answer ended: what the readers held, and the last block closed."""
        events = self._events(self._output.finish())
        if self._open is not None:
            events.append(BlockEvent("closed", self._open))
            self._open = None
        return events

    def _events(self, pieces: list[Piece]) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        for piece in pieces:
            events += self._piece(piece)
        return events

    def _piece(self, piece: Piece) -> list[BlockEvent]:
        if isinstance(piece, CallStart):
            events = self._start(Block("call", len(self.blocks), call_id=piece.id, name=piece.name))
            self._calls[piece.index] = self.blocks[-1]
            return events
        if isinstance(piece, ArgumentsDelta):
            return self._grow(self._calls[piece.index], piece.text, [])
        if not piece.text:  # an empty piece opens nothing: no empty text blocks
            return []
        kind = "reasoning" if isinstance(piece, ReasoningDelta) else "text"
        assert isinstance(piece, ReasoningDelta | ContentDelta)
        if self._open is not None and self._open.kind == kind:
            return self._grow(self._open, piece.text, [])
        events = self._start(Block(kind, len(self.blocks)))
        return self._grow(self.blocks[-1], piece.text, events)

    def _start(self, block: Block) -> list[BlockEvent]:
        events: list[BlockEvent] = [BlockEvent("closed", self._open)] if self._open is not None else []
        self.blocks.append(block)
        self._open = block
        return [*events, BlockEvent("opened", block)]

    @staticmethod
    def _grow(block: Block, text: str, events: list[BlockEvent]) -> list[BlockEvent]:
        block.text += text
        return [*events, BlockEvent("grew", block, text)] if text else events


def read_blocks(text: str, spec: OutputSpec) -> BlockReader:
    """A whole answer's blocks (the reader, finished: its `blocks` and `n_calls`)."""
    reader = BlockReader(spec)
    reader.feed(text)
    reader.finish()
    return reader
