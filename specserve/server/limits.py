"""Back-pressure: a largest request body (413) and a longest queue of generation requests (503); the
register of running generation requests that a graceful shutdown waits for and then ends.

Both answer before the work is done: a body over the limit is refused from its Content-Length
without being read (or as soon as that many bytes came, for chunked bodies), and a generation
request over the queue limit is refused before it is parsed or tokenized.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specserve.engine.tasks import Cancellable
from specserve.errors import SpecserveError
from specserve.server.errors import Unavailable, error_response
from specserve.server.middleware import HttpMiddleware


def _too_large(max_bytes: int) -> str:
    return f"the request body is larger than this server accepts ({max_bytes} bytes, --max-body-bytes)"


def _content_length(scope: Scope) -> int | None:
    for key, value in scope["headers"]:
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:  # the HTTP parser refuses these before us; be safe anyway
                return None
    return None


class BodyLimitMiddleware(HttpMiddleware):
    """413 for bodies over max_bytes."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        super().__init__(app)
        self.max_bytes = max_bytes

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            # Answer without reading: the server discards the rest of the body as it arrives.
            await error_response(413, _too_large(self.max_bytes), path=scope["path"])(scope, receive, send)
            return
        received = 0

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # a chunked body: the route's exception handler answers
                    raise StarletteHTTPException(413, _too_large(self.max_bytes))
            return message

        await self.app(scope, counted_receive, send)


SHUTTING_DOWN = "the server is shutting down"


@dataclass
class Interrupted:
    """Put in a request's event queue when the server ends it (the shutdown grace period is over)."""

    message: str


@dataclass(eq=False)
class Ticket:
    """One admitted generation request, from admission until its response is complete."""

    admission: Admission
    handles: list[Cancellable] = field(default_factory=list)  # its tasks, once submitted to the scheduler
    queue: asyncio.Queue[Any] | None = None  # where its events arrive
    interrupted: str | None = None  # why the server ended it before it was submitted
    weight: int = 1  # tasks it holds (a batch of prompts, n choices): what the queue limit counts

    def cancel(self) -> None:
        """Stop its tasks that still run (a no-op for finished ones)."""
        for handle in self.handles:
            handle.cancel()

    def interrupt(self, message: str) -> None:
        """End the request now: its response says why (an error event for streams)."""
        self.interrupted = message
        self.cancel()
        if self.queue is not None:
            self.queue.put_nowait(Interrupted(message))

    def release(self) -> None:
        """The response is complete or abandoned: stop its tasks if they still run."""
        self.cancel()
        self.admission.active.discard(self)


class Admission:
    """Counts generation tasks in the server (tokenizing, queued or running); lives on the event loop."""

    def __init__(self, n_slots: int, max_queue: int):
        self.n_slots = n_slots
        self.max_queue = max_queue
        self.active: set[Ticket] = set()
        self.draining = False  # shutting down: admit nothing more

    @property
    def limit(self) -> int:
        return self.n_slots + self.max_queue

    def _load(self) -> int:
        return sum(t.weight for t in self.active)

    def _busy(self) -> Unavailable:
        return Unavailable(f"the server is busy: {self.n_slots} slots taken and {self.max_queue} requests "
                           "waiting (--max-queue); retry later")

    def admit(self) -> Ticket:
        if self.draining:
            raise Unavailable(SHUTTING_DOWN)
        if self._load() >= self.limit:
            raise self._busy()
        ticket = Ticket(self)
        self.active.add(ticket)
        return ticket

    def widen(self, ticket: Ticket, n_tasks: int) -> None:
        """The request turned out to hold n_tasks tasks: count them all (checked before any is queued)."""
        if n_tasks > self.limit:  # could never be admitted: the request's fault, not the server's load
            raise SpecserveError(f"a request may hold at most {self.limit} tasks (prompts x choices; the slots "
                                 f"plus --max-queue), this one holds {n_tasks}")
        if self._load() - ticket.weight + n_tasks > self.limit:
            raise self._busy()
        ticket.weight = n_tasks

    def interrupt_all(self, message: str) -> int:
        tickets = list(self.active)
        for ticket in tickets:
            ticket.interrupt(message)
        return len(tickets)
