"""Work on a slot's KV sequence that is not a generation (embeddings, slot save / restore / erase), run by
the scheduler's thread, which owns the runner, between steps.

A job runs when no step is in flight and its slot is idle: a given slot (a busy one's job waits until it is
free, as llama-server defers a slot action), or any idle slot, the least recently used. While a job could
run, the scheduler queues no step ahead of the one in flight, so a job waits at most one step for a busy
server's next step boundary.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from specserve.engine.kv_room import KVMemory, KVRoom
from specserve.engine.runner import Runner
from specserve.engine.slots import Slot
from specserve.errors import SpecserveError
from specserve.model.kv_ledger import KVCacheFull

log = logging.getLogger(__name__)

JobWork = Callable[[Slot], Any]  # runs on the scheduler's thread with its (idle) slot; its value is the result


@dataclass
class SlotJob:
    work: JobWork
    slot: int | None  # None: any idle slot
    future: Future[Any] = field(default_factory=Future)


class JobQueue:
    """The scheduler's slot jobs: queued from any thread, run by the scheduler's thread between steps. It shares
    the scheduler's slots, lock and pool memory; `stopping()` says whether the scheduler is shutting down."""

    def __init__(self, runner: Runner, slots: list[Slot], lock: threading.Condition, memory: KVMemory,
                 stopping: Callable[[], bool]):
        self.runner = runner
        self.slots = slots
        self._cond = lock
        self.memory = memory
        self._stopping = stopping
        self._jobs: deque[SlotJob] = deque()

    @property
    def pending(self) -> bool:
        return bool(self._jobs)

    def submit(self, work: JobWork, slot: int | None = None) -> Future[Any]:
        """Run work(slot) on the scheduler's thread once `slot` (None: any slot) is idle; thread-safe. The future
        holds its value, or its exception (SpecserveError for bad input)."""
        if slot is not None and not 0 <= slot < len(self.slots):
            raise SpecserveError(f"Invalid slot ID {slot} (this server has slots 0..{len(self.slots) - 1})")
        job = SlotJob(work, slot)
        with self._cond:
            if self._stopping():
                raise SpecserveError("the server is shutting down")
            self._jobs.append(job)
            self._cond.notify_all()
        return job.future

    def _idle_slot(self, job: SlotJob) -> Slot | None:
        if job.slot is not None:
            slot = self.slots[job.slot]
            return slot if slot.handle is None else None
        idle = [s for s in self.slots if s.handle is None]
        return min(idle, key=lambda s: s.last_used) if idle else None

    def ready(self) -> bool:
        return any(self._idle_slot(job) is not None for job in self._jobs)

    def run(self) -> None:
        """(No step in flight.) Run every job whose slot is idle, in order of submission."""
        with self._cond:
            ready = [(job, slot) for job in self._jobs if (slot := self._idle_slot(job)) is not None]
            for job, _ in ready:
                self._jobs.remove(job)
        for job, slot in ready:
            if job.future.set_running_or_notify_cancel():
                try:
                    job.future.set_result(self._with_room(job.work, slot))
                except Exception as exc:
                    if not isinstance(exc, SpecserveError):
                        log.exception("slot job on slot %d failed", slot.id)
                    job.future.set_exception(exc)
            slot.last_used = time.perf_counter()

    def _with_room(self, work: JobWork, slot: Slot) -> Any:
        """work(slot); where the KV pool had no room for it, again after idle caches were given up (KVCacheFull
        from the second try: running requests hold the rest)."""
        try:
            return work(slot)
        except KVCacheFull:
            self.memory.evict_idle(KVRoom(self.runner.ledger.blocks, most=1 << 62), 1 << 62)
            return work(slot)

    def fail_all(self, message: str) -> None:
        """(Under the lock.)"""
        while self._jobs:
            job = self._jobs.popleft()
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(SpecserveError(message))
