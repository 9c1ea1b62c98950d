"""From a submitted Task to an HTTP response: collected JSON or server-sent events.

The scheduler thread emits events into the request's asyncio queue; a client that hangs up
cancels its task. Every response holds its admission ticket until it is complete.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from specserve.engine.tasks import Chunk, Event, Failure, Result, Task
from specserve.server.engine import Engine
from specserve.server.errors import Unavailable, error_body, error_response
from specserve.server.formats import Format
from specserve.server.limits import Interrupted, Ticket
from specserve.server.request_log import note_result


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class ClientGone(Exception):
    pass


_DISCONNECTED = object()


def _subscribe(engine: Engine, task: Task, ticket: Ticket) -> asyncio.Queue[Any]:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()

    def emit(event: Event) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, event)

    if ticket.interrupted:  # ended while it was being tokenized
        raise Unavailable(ticket.interrupted)
    ticket.queue = queue
    ticket.handle = engine.scheduler.submit(task, emit)
    return queue


async def _watch_disconnect(request: Request, ticket: Ticket) -> None:
    """The body is read already, so the next ASGI message is the client hanging up."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            assert ticket.handle is not None and ticket.queue is not None
            ticket.handle.cancel()
            ticket.queue.put_nowait(_DISCONNECTED)
            return


async def _collect(request: Request, queue: asyncio.Queue[Any], ticket: Ticket) -> tuple[list[Chunk], Result]:
    watcher = asyncio.create_task(_watch_disconnect(request, ticket))
    try:
        chunks: list[Chunk] = []
        while True:
            event = await queue.get()
            if isinstance(event, Chunk):
                chunks.append(event)
            elif isinstance(event, Result):
                note_result(request.scope, event)
                return chunks, event
            elif isinstance(event, Failure):
                raise RuntimeError(event.message)
            elif isinstance(event, Interrupted):
                raise Unavailable(event.message)
            else:
                raise ClientGone()
    finally:
        watcher.cancel()


async def _events(request: Request, queue: asyncio.Queue[Any], fmt: Format) -> AsyncIterator[str]:
    for obj in fmt.start():
        yield sse(obj)
    while True:
        event = await queue.get()
        if isinstance(event, Chunk):
            obj = fmt.chunk(event)
            if obj is not None:
                yield sse(obj)
        elif isinstance(event, Result):
            note_result(request.scope, event)
            for obj in fmt.final(event):
                yield sse(obj)
            break
        else:  # Failure, or the server ending the stream
            yield sse(error_body(503 if isinstance(event, Interrupted) else 500, event.message))
            break
    if fmt.done_marker:
        yield "data: [DONE]\n\n"


class TicketStream(StreamingResponse):
    """An SSE response that gives its ticket back however it ends (even if it never started streaming)."""

    def __init__(self, content: AsyncIterator[str], ticket: Ticket):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.ticket = ticket

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.ticket.release()


async def respond(request: Request, engine: Engine, task: Task, fmt: Format, stream: bool,
                  ticket: Ticket) -> Response:
    """Submit task and answer; the ticket is released (and the task cancelled, if it still runs) when
    the answer is complete or abandoned, e.g. when Starlette cancels a stream whose client went away."""
    queue = _subscribe(engine, task, ticket)
    if stream:
        return TicketStream(_events(request, queue, fmt), ticket)
    try:
        chunks, result = await _collect(request, queue, ticket)
    except ClientGone:
        return Response(status_code=499)
    except Unavailable as exc:
        return exc.response()
    except RuntimeError as exc:
        return error_response(500, str(exc))
    finally:
        ticket.release()
    return JSONResponse(fmt.body(chunks, result))
