"""From submitted Tasks (one per prompt and choice) to an HTTP response: collected JSON or server-sent events.

The scheduler thread emits events into the request's asyncio queue; a client that hangs up
cancels its tasks. Every response holds its admission ticket until it is complete.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from specserve.engine.tasks import Chunk, Event, Failure, Progress, Result, Task
from specserve.server.engine import Engine
from specserve.server.errors import Unavailable
from specserve.server.formats import Format, NativeFormat, OpenAIFormat
from specserve.server.limits import Interrupted, Ticket
from specserve.server.request_log import note_result


@dataclass
class Job:
    """What a generation route built: its tasks (one per prompt and choice), a format for each, and how it
    answers."""

    tasks: list[Task]
    formats: list[Format]
    stream: bool
    verbose: bool = False  # the server's --verbose: an OpenAI answer carries `__verbose`

    def __post_init__(self) -> None:
        for i, fmt in enumerate(self.formats):
            fmt.place(i, self.formats[0])


class ClientGone(Exception):
    pass


_DISCONNECTED = object()


class Doorbell:
    """Events from the scheduler thread into the event loop's queues, with one wake-up per batch: a step hands
    out an event to each of its slots, and a call_soon_threadsafe each (a write to the loop's wake-up pipe,
    the loop woken up again and again) costs more than the delivery at 64 slots."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue[Any], Any]] = []

    def post(self, queue: asyncio.Queue[Any], item: Any) -> None:
        with self._lock:
            ring = not self._pending  # the first since the last delivery schedules it
            self._pending.append((queue, item))
        if ring:
            try:
                self._loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:  # the loop is closed: its queues have no readers left
                with self._lock:
                    self._pending.clear()
                raise

    def _deliver(self) -> None:
        with self._lock:
            items, self._pending = self._pending, []
        for queue, item in items:
            queue.put_nowait(item)


_doorbells: dict[asyncio.AbstractEventLoop, Doorbell] = {}


def _doorbell(loop: asyncio.AbstractEventLoop) -> Doorbell:
    bell = _doorbells.get(loop)
    if bell is None:
        for old in [old for old in _doorbells if old.is_closed()]:  # test clients make and close loops
            del _doorbells[old]
        bell = _doorbells[loop] = Doorbell(loop)
    return bell


def _subscribe(engine: Engine, job: Job, ticket: Ticket) -> asyncio.Queue[Any]:
    """Submit every task; their events arrive in one queue as (task index, event)."""
    bell = _doorbell(asyncio.get_running_loop())
    queue: asyncio.Queue[Any] = asyncio.Queue()

    def emitter(i: int) -> Callable[[Event], None]:
        return lambda event: bell.post(queue, (i, event))

    if ticket.interrupted:  # ended while it was being tokenized
        raise Unavailable(ticket.interrupted)
    ticket.queue = queue
    for i, task in enumerate(job.tasks):
        ticket.handles.append(engine.core.submit(task, emitter(i)))
    return queue


async def _watch_disconnect(request: Request, ticket: Ticket) -> None:
    """The body is read already, so the next ASGI message is the client hanging up."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            assert ticket.queue is not None
            ticket.cancel()
            ticket.queue.put_nowait(_DISCONNECTED)
            return


def _note(request: Request, results: list[Result]) -> None:
    """The request log's line counts every task's tokens."""
    first = results[0]
    note_result(request.scope, replace(first, n_prompt=sum(r.n_prompt for r in results),
                                       n_cached=sum(r.n_cached for r in results),
                                       n_predicted=sum(r.n_predicted for r in results)))


async def _collect(request: Request, queue: asyncio.Queue[Any], ticket: Ticket,
                   n: int) -> tuple[list[list[Chunk]], list[Result]]:
    watcher = asyncio.create_task(_watch_disconnect(request, ticket))
    try:
        chunks: list[list[Chunk]] = [[] for _ in range(n)]
        results: dict[int, Result] = {}
        while len(results) < n:
            item = await queue.get()
            i, event = item if isinstance(item, tuple) else (-1, item)
            if isinstance(event, Chunk):
                chunks[i].append(event)
            elif isinstance(event, Progress):
                continue  # (prompt progress goes to streams only)
            elif isinstance(event, Result):
                results[i] = event
            elif isinstance(event, Failure):
                raise RuntimeError(event.message)
            elif isinstance(event, Interrupted):
                raise Unavailable(event.message)
            else:
                raise ClientGone()
        ordered = [results[i] for i in range(n)]
        _note(request, ordered)
        return chunks, ordered
    finally:
        watcher.cancel()


async def _events(request: Request, queue: asyncio.Queue[Any], job: Job) -> AsyncIterator[bytes]:
    formats = job.formats
    for fmt in formats:
        for obj in fmt.start():
            yield fmt.sse(obj)
    results: dict[int, Result] = {}
    failed = False
    while len(results) < len(formats) and not failed:
        items = [await queue.get()]
        while not queue.empty():  # what else arrived meanwhile goes out in the same send (a loop that lags
            items.append(queue.get_nowait())  # behind the steps catches up in fewer, larger writes)
        out: list[bytes] = []
        for item in items:
            i, event = item if isinstance(item, tuple) else (-1, item)
            if isinstance(event, Chunk):
                objs = formats[i].chunk(event)
                if event.timings is not None and objs and not formats[i].named_events:
                    objs[-1]["timings"] = event.timings  # timings_per_token, on the step's last event
                out += [formats[i].sse(obj) for obj in objs]
            elif isinstance(event, Progress):
                out += [formats[i].sse(obj) for obj in formats[i].progress(event)]
            elif isinstance(event, Result):
                results[i] = event
                out += [formats[i].sse(obj) for obj in formats[i].final(event)]
            else:  # Failure, or the server ending the stream
                status = 503 if isinstance(event, Interrupted) else 500
                out.append(formats[0].sse(formats[0].stream_error(status, event.message)))
                failed = True
                break
        if out:
            yield b"".join(out)
    if not failed:
        ordered = [results[i] for i in range(len(formats))]
        _note(request, ordered)
        for obj in formats[0].tail(ordered, formats):
            yield formats[0].sse(obj)
    if formats[0].done_marker:
        yield b"data: [DONE]\n\n"


class TicketStream(StreamingResponse):
    """An SSE response that gives its ticket back however it ends (even if it never started streaming)."""

    def __init__(self, content: AsyncIterator[bytes], ticket: Ticket):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.ticket = ticket

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.ticket.release()


def _error(job: Job, status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """An error answer in the shape of the job's API."""
    return JSONResponse(job.formats[0].error(status, message), status_code=status, headers=headers)


async def respond(request: Request, engine: Engine, job: Job, ticket: Ticket) -> Response:
    """Submit the job's tasks and answer; the ticket is released (and tasks still running cancelled) when
    the answer is complete or abandoned, e.g. when Starlette cancels a stream whose client went away."""
    queue = _subscribe(engine, job, ticket)
    if job.stream:
        return TicketStream(_events(request, queue, job), ticket)
    try:
        chunks, results = await _collect(request, queue, ticket, len(job.tasks))
    except ClientGone:
        return Response(status_code=499)
    except Unavailable as exc:
        return _error(job, 503, str(exc), {"Retry-After": str(exc.retry_after)})
    except RuntimeError as exc:
        return _error(job, 500, str(exc))
    finally:
        ticket.release()
    formats = job.formats
    bodies = [fmt.body(c, r) for fmt, c, r in zip(formats, chunks, results, strict=True)]
    answer = formats[0].combine(bodies, results, formats)
    if job.verbose and isinstance(answer, dict) and isinstance(formats[0], OpenAIFormat):
        # llama-server's --verbose: an OpenAI answer also carries the native /completion body of its first task
        answer["__verbose"] = NativeFormat(engine, job.tasks[0], return_tokens=True).body(chunks[0], results[0])
    return JSONResponse(answer)
