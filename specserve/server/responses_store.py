"""Past responses' conversations, for a Responses request's `previous_response_id`.

Each stored response keeps its whole conversation as chat messages: the stored conversation it went on from, its
input, and its output (not its instructions, which OpenAI does not carry over either). The store is in memory and
bounded: at most `capacity` responses, the least recently used given up first, each for `ttl` seconds at most.
A restart forgets them all; a client that needs more sends the conversation's items itself.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

from specserve.server.errors import RequestError, error_response

TTL_S = 3600.0


@dataclass(frozen=True)
class _Entry:
    messages: list[dict[str, Any]]
    stored_at: float


class ResponseNotFound(RequestError):
    """A previous_response_id the store does not hold (never stored, given up, or expired)."""

    status = 404

    def __init__(self, response_id: str):
        super().__init__(f"Previous response with id '{response_id}' not found.")

    def response(self) -> JSONResponse:
        return error_response(404, str(self), code="previous_response_not_found", type="invalid_request_error",
                              param="previous_response_id")


class ResponseStore:
    """Thread-safe: requests are built in worker threads and stored from the event loop."""

    def __init__(self, capacity: int = 256, ttl: float = TTL_S, clock: Callable[[], float] = time.monotonic):
        self.capacity = capacity
        self.ttl = ttl
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        if self.capacity <= 0:
            return
        with self._lock:
            now = self._clock()
            for old in [key for key, entry in self._entries.items() if now - entry.stored_at > self.ttl]:
                del self._entries[old]
            self._entries[response_id] = _Entry(messages, now)
            self._entries.move_to_end(response_id)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """The stored conversation (a copy's worth: the caller may extend the list); ResponseNotFound if none."""
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None and self._clock() - entry.stored_at > self.ttl:
                del self._entries[response_id]
                entry = None
            if entry is None:
                raise ResponseNotFound(response_id)
            self._entries.move_to_end(response_id)
            return list(entry.messages)
