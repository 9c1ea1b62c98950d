"""llama-server's --sleep-idle-seconds: after that long with no work, the engine core lets its model and KV go
(its process exits, or a thread-local core's runners are dropped), and the next work loads them again.

`SleepingCore` wraps the loaded core. Work is a task or a slot job from submission to its last event;
`/health`, `/props`, `/slots` and `/metrics` answer while it sleeps and never wake it (llama-server's `/slots` and
`/metrics` reset its timer). A request wakes it from its worker thread (`wake`) before its tasks are submitted on
the event loop, so the loop never waits for a load; the counters carry on across sleeps.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from specserve.engine.slots import SchedulerCounters, Slot
from specserve.engine.tasks import Cancellable, Event, Failure, Result, Task
from specserve.server.core import CoreJob, EngineCore

log = logging.getLogger(__name__)


class SleepingCore:
    def __init__(self, core: EngineCore, load: Callable[[], EngineCore], idle_seconds: float, n_slots: int,
                 n_ctx: int):
        self._core: EngineCore | None = core
        self._load = load
        self._idle = idle_seconds
        self._n_slots, self._n_ctx = n_slots, n_ctx
        self._lock = threading.Lock()  # held while loading or letting go: work waits for either to finish
        self._busy = 0  # tasks and jobs submitted and not ended
        self._last = time.monotonic()
        self._earlier = SchedulerCounters()  # the cores' before this one, summed
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="sleep-idle", daemon=True)
        self._watcher.start()

    @property
    def sleeping(self) -> bool:
        return self._core is None

    def wake(self) -> None:
        """Load the model again if it sleeps (blocking: call it off the event loop); work is near."""
        with self._lock:
            self._loaded()

    def _loaded(self) -> EngineCore:
        """(Lock held.) The core, loaded first if it sleeps; the idle time counts from now."""
        if self._core is None:
            log.info("waking up: loading the model again")
            t0 = time.perf_counter()
            self._core = self._load()
            log.info("awake after %.1f s", time.perf_counter() - t0)
        self._last = time.monotonic()
        return self._core

    def _begin(self) -> EngineCore:
        with self._lock:  # (one hold: the watcher cannot let the core go between the two)
            core = self._loaded()
            self._busy += 1
            return core

    def _end(self) -> None:
        with self._lock:
            self._busy -= 1
            self._last = time.monotonic()

    def submit(self, task: Task, emit: Callable[[Event], None]) -> Cancellable:
        core = self._begin()

        def on_event(event: Event) -> None:
            emit(event)
            if isinstance(event, Result | Failure):
                self._end()

        try:
            return core.submit(task, on_event)
        except BaseException:
            self._end()
            raise

    def submit_job(self, work: CoreJob, slot: int | None = None) -> Future[Any]:
        core = self._begin()
        try:
            future = core.submit_job(work, slot)
        except BaseException:
            self._end()
            raise
        future.add_done_callback(lambda _: self._end())
        return future

    def slots_json(self) -> list[dict[str, object]]:
        core = self._core
        if core is None:  # (every cache went with the model)
            return [Slot(i).to_json(self._n_ctx) for i in range(self._n_slots)]
        return core.slots_json()

    def counters(self) -> SchedulerCounters:
        core = self._core
        if core is None:
            return SchedulerCounters().after(self._earlier)
        return core.counters().after(self._earlier)

    def failure(self) -> str | None:
        core = self._core
        return core.failure() if core is not None else None

    def shutdown(self) -> None:
        self._stop.set()
        with self._lock:
            if self._core is not None:
                self._core.shutdown()
                self._core = None

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self._idle / 4)):
            with self._lock:
                core = self._core
                if core is None or self._busy or time.monotonic() - self._last < self._idle:
                    continue
                log.info("idle for %.0f s: sleeping (the model and its KV let go)", self._idle)
                self._earlier = core.counters().after(self._earlier)
                self._core = None  # (/slots and /metrics answer as asleep from now on)
                core.shutdown()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
