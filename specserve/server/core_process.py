"""The engine core's process: loads the model, runs the scheduler, and talks to the HTTP front over ZeroMQ.

Two sockets on unix paths the front chose: the front PUSHes requests (submit, cancel, slot jobs, queries);
the core PUSHes back replies and each scheduler turn's events as one message (one socket, used by the main
thread and the scheduler's under a lock). Messages are pickled tuples:

    front -> core   ("submit", task, grammar)  ("cancel", task_id)  ("job", id, work, slot)
                    ("slots", id)  ("counters", id)  ("shutdown",)
    core -> front   ("ready", ModelFacts) | ("failed", message)   once, after loading
                    ("reply", id, ok, value)   a query's answer, or a job that could not be queued
                    ("turn", [item, ...])      ("event", task_id, Event) and ("job", id, ok, value) items
                    ("stopped",)               after the shutdown's drain

A task's grammar travels as its source and is compiled here (a matcher does not cross processes). The core
ignores SIGINT and SIGTERM (the front drains and then tells it to stop) and exits when its parent is gone.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import threading
from typing import Any

import torch
import zmq

from specserve.engine.constraints import GrammarCompiler, GrammarSource
from specserve.engine.runner import model_file
from specserve.engine.tasks import Event, Failure, Result, Task, TaskHandle
from specserve.errors import SpecserveError
from specserve.gguf.tokenizer import Tokenizer
from specserve.server.core import CoreJob, Loader, LocalCore, ModelFacts, load_model
from specserve.server.settings import ServerSettings

log = logging.getLogger(__name__)

_PARENT_CHECK_MS = 1000


class _Outbox:
    """The socket to the front: items of the scheduler's turn, sent as one message when the turn ends, and
    replies, sent at once (from either thread)."""

    def __init__(self, socket: zmq.Socket[Any]):
        self._socket = socket
        self._lock = threading.Lock()
        self._items: list[tuple[Any, ...]] = []

    def add(self, item: tuple[Any, ...]) -> None:
        with self._lock:
            self._items.append(item)

    def flush(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            if items:
                self._socket.send(pickle.dumps(("turn", items), protocol=pickle.HIGHEST_PROTOCOL))

    def send(self, message: tuple[Any, ...]) -> None:
        with self._lock:
            self._socket.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def main(settings: ServerSettings, requests_addr: str, events_addr: str, log_level: int,
         loader: Loader = load_model) -> None:
    """The core process's entry point (multiprocessing, spawn); loader: what builds the runners (a benchmark's
    stand-in runner, say)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("specserve").setLevel(log_level)
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    ctx = zmq.Context()
    requests = ctx.socket(zmq.PULL)
    requests.connect(requests_addr)
    events = ctx.socket(zmq.PUSH)
    events.connect(events_addr)
    outbox = _Outbox(events)
    try:
        runner, draft_runner, path = loader(settings)
        tokenizer = Tokenizer.from_gguf(model_file(runner))
        core = LocalCore(settings, runner, draft_runner, tokenizer)
        grammars = GrammarCompiler(tokenizer)
        grammars.warm()
    except Exception as exc:
        if not isinstance(exc, SpecserveError):
            log.exception("the engine core could not load the model")
        outbox.send(("failed", str(exc)))
        ctx.destroy(linger=2000)
        return
    outbox.send(("ready", ModelFacts.of(path, runner, draft_runner)))
    core.scheduler.after_turn = outbox.flush
    core.start()
    try:
        _serve(requests, core, grammars, outbox)
    finally:
        core.shutdown()  # the drain's events go out through after_turn
        outbox.flush()
        outbox.send(("stopped",))
        ctx.destroy(linger=2000)


def _serve(requests: zmq.Socket[Any], core: LocalCore, grammars: GrammarCompiler, outbox: _Outbox) -> None:
    handles: dict[int, TaskHandle] = {}
    parent = os.getppid()

    def reply(request_id: int, ok: bool, value: object) -> None:
        outbox.send(("reply", request_id, ok, value))

    def emitter(task_id: int) -> Any:
        def emit(event: Event) -> None:
            if isinstance(event, Result | Failure):
                handles.pop(task_id, None)
            outbox.add(("event", task_id, event))
        return emit

    def job_done(job_id: int) -> Any:
        def done(future: Any) -> None:
            exc = future.exception()
            outbox.add(("job", job_id, exc is None, exc if exc is not None else future.result()))
        return done

    while True:
        if not requests.poll(_PARENT_CHECK_MS):
            if os.getppid() != parent:  # the front died without telling us
                return
            continue
        message = pickle.loads(requests.recv())
        kind = message[0]
        if kind == "submit":
            task, grammar = message[1], message[2]
            submit(core, task, grammar, grammars, handles, emitter(task.id), outbox)
        elif kind == "cancel":
            handle = handles.get(message[1])
            if handle is not None:
                handle.cancel()
        elif kind == "job":
            job_id, work, slot = message[1], message[2], message[3]
            start_job(core, job_id, work, slot, outbox, job_done(job_id))
        elif kind == "slots":
            reply(message[1], True, core.slots_json())
        elif kind == "counters":
            reply(message[1], True, core.counters())
        elif kind == "shutdown":
            return


def submit(core: LocalCore, task: Task, grammar: GrammarSource | None, grammars: GrammarCompiler,
           handles: dict[int, TaskHandle], emit: Any, outbox: _Outbox) -> None:
    """Queue the task; a task the scheduler refuses ends at once with a Failure (the front checked it first)."""
    try:
        task.constraint = grammars.compile(grammar) if grammar is not None else None
        handle = core.scheduler.submit(task, emit)
    except SpecserveError as exc:
        outbox.add(("event", task.id, Failure(str(exc))))
        outbox.flush()
        return
    handles[task.id] = handle


def start_job(core: LocalCore, job_id: int, work: CoreJob, slot: int | None, outbox: _Outbox, done: Any) -> None:
    try:
        future = core.submit_job(work, slot)
    except SpecserveError as exc:
        outbox.send(("reply", job_id, False, exc))
        return
    future.add_done_callback(done)  # on the scheduler's thread before its turn's flush, or here if done already
    if future.done():
        outbox.flush()
