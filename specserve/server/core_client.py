"""The HTTP front's side of an engine core in its own process (core_process.py): an EngineCore whose
scheduler runs elsewhere.

A thread of the front receives the core's messages and hands each event to its task's `emit` (which posts it
into the request's asyncio queue), so the event loop only ever sees ready events. If the core process dies,
every task and job still open fails with a message saying so, and later requests get one too.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import pickle
import shutil
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import zmq

from specserve.engine.slots import SchedulerCounters
from specserve.engine.tasks import Event, Failure, Result, Task, check_task
from specserve.errors import SpecserveError
from specserve.server import core_process
from specserve.server.core import CoreJob, Loader, ModelFacts, load_model
from specserve.server.errors import Unavailable
from specserve.server.settings import ServerSettings

log = logging.getLogger(__name__)

_QUERY_TIMEOUT_S = 30.0
_POLL_MS = 500
_GONE = "the engine core stopped"


class _RemoteHandle:
    def __init__(self, client: CoreClient, task_id: int):
        self._client = client
        self._task_id = task_id

    def cancel(self) -> None:
        self._client.cancel(self._task_id)


class CoreClient:
    """Starts the engine core's process, waits until it has loaded the model, and speaks for it."""

    def __init__(self, settings: ServerSettings, load_timeout: float | None = None, loader: Loader = load_model):
        self.settings = settings
        self._dir = tempfile.mkdtemp(prefix="specserve-core-")
        self._ctx = zmq.Context()
        self._out = self._ctx.socket(zmq.PUSH)
        self._out.bind(f"ipc://{self._dir}/requests")
        self._in = self._ctx.socket(zmq.PULL)
        self._in.bind(f"ipc://{self._dir}/events")
        self._send_lock = threading.Lock()
        self._emits: dict[int, Callable[[Event], None]] = {}
        self._replies: dict[int, Future[Any]] = {}
        self._ids = itertools.count()
        self._gone: str | None = None
        self._stopped = threading.Event()
        spawn = multiprocessing.get_context("spawn")
        self._process = spawn.Process(
            target=core_process.main, name="specserve-core", daemon=True,
            args=(settings, f"ipc://{self._dir}/requests", f"ipc://{self._dir}/events",
                  logging.getLogger("specserve").getEffectiveLevel(), loader))
        self._process.start()
        try:
            self.model: ModelFacts = self._wait_ready(load_timeout)
        except BaseException:
            self._close()
            raise
        self._receiver = threading.Thread(target=self._receive, name="specserve-core-events", daemon=True)
        self._receiver.start()

    def _wait_ready(self, timeout: float | None) -> ModelFacts:
        waited = 0.0
        while not self._in.poll(_POLL_MS):
            waited += _POLL_MS / 1000
            if not self._process.is_alive():
                raise SpecserveError(f"the engine core exited while loading the model (exit code "
                                     f"{self._process.exitcode})")
            if timeout is not None and waited > timeout:
                raise SpecserveError(f"the engine core did not load the model in {timeout:g} s")
        message = pickle.loads(self._in.recv())
        if message[0] == "failed":
            raise SpecserveError(message[1])
        assert message[0] == "ready", message
        return message[1]

    # -- EngineCore ---------------------------------------------------------------------------------

    def submit(self, task: Task, emit: Callable[[Event], None]) -> _RemoteHandle:
        check_task(task, self.model.n_ctx, speculates=True)
        grammar = task.constraint.source if task.constraint is not None else None
        sent = task if task.constraint is None else replace(task, constraint=None)
        self._emits[task.id] = emit
        try:
            self._send(("submit", sent, grammar))
        except Unavailable:
            del self._emits[task.id]
            raise
        return _RemoteHandle(self, task.id)

    def cancel(self, task_id: int) -> None:
        with contextlib.suppress(Unavailable):  # a core that is gone has ended the task already
            self._send(("cancel", task_id))

    def submit_job(self, work: CoreJob, slot: int | None = None) -> Future[Any]:
        if slot is not None and not 0 <= slot < self.settings.n_parallel:
            raise SpecserveError(f"Invalid slot ID {slot} (this server has slots 0..{self.settings.n_parallel - 1})")
        job_id, future = self._expect()
        self._send(("job", job_id, work, slot))
        return future

    def slots_json(self) -> list[dict[str, object]]:
        return self._query("slots")  # type: ignore[no-any-return]

    def counters(self) -> SchedulerCounters:
        return self._query("counters")  # type: ignore[no-any-return]

    def shutdown(self) -> None:
        """Drain the core (its open tasks end with a Failure) and wait for its process to exit."""
        if self._gone is None:
            with contextlib.suppress(Unavailable):
                self._send(("shutdown",))
            self._stopped.wait(15.0)
        self._process.join(10.0)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5.0)
        self._fail_all(_GONE)
        self._close()

    # -- plumbing -------------------------------------------------------------------------------------

    def failure(self) -> str | None:
        return self._gone

    def wake(self) -> None:
        pass  # (loaded while its process lives)

    def _send(self, message: tuple[Any, ...]) -> None:
        if self._gone is not None:
            raise Unavailable(self._gone)
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self._out.send(data)

    def _expect(self) -> tuple[int, Future[Any]]:
        request_id = next(self._ids)
        future: Future[Any] = Future()
        self._replies[request_id] = future
        return request_id, future

    def _query(self, kind: str) -> Any:
        request_id, future = self._expect()
        self._send((kind, request_id))
        return future.result(_QUERY_TIMEOUT_S)

    def _receive(self) -> None:
        try:
            self._receive_until_stopped()
        except zmq.ZMQError:  # the context was closed under it (shutdown)
            self._fail_all(_GONE)

    def _receive_until_stopped(self) -> None:
        while True:
            if not self._in.poll(_POLL_MS):
                if not self._process.is_alive():
                    log.error("the engine core's process exited (code %s)", self._process.exitcode)
                    self._fail_all(_GONE)
                    return
                continue
            message = pickle.loads(self._in.recv())
            kind = message[0]
            if kind == "turn":
                for item in message[1]:
                    if item[0] == "event":
                        self._deliver(item[1], item[2])
                    else:
                        self._resolve(item[1], item[2], item[3])
            elif kind == "reply":
                self._resolve(message[1], message[2], message[3])
            elif kind == "stopped":
                self._fail_all(_GONE)
                self._stopped.set()
                return

    def _deliver(self, task_id: int, event: Event) -> None:
        emit = self._emits.pop(task_id, None) if isinstance(event, Result | Failure) else self._emits.get(task_id)
        if emit is None:
            return
        try:
            emit(event)
        except Exception:  # the receiver is gone (its event loop closed): nothing to tell
            log.debug("dropped an event for task %d", task_id)

    def _resolve(self, request_id: int, ok: bool, value: Any) -> None:
        future = self._replies.pop(request_id, None)
        if future is None:
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def _fail_all(self, message: str) -> None:
        self._gone = self._gone or message
        for task_id in list(self._emits):
            self._deliver(task_id, Failure(message))
        for request_id in list(self._replies):
            self._resolve(request_id, False, SpecserveError(message))

    def _close(self) -> None:
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)
