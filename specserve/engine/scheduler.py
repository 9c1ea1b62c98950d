"""The scheduler: the one decode loop. Slots, continuous batching, speculative decoding per slot, and the
host a step ahead of the device.

Every step is ONE Batch over all active slots — prompt chunks for slots still reading, `[last sampled] +
draft` for generating slots — and each slot's own sampler verifies its rows. When every slot in the step
in flight needs only the argmax of its rows (greedy, no probabilities) and drafted nothing, the next step
is queued before that one is read: its rows take their first token from the step in flight's argmax on
the device (`Runner.launch(fed=...)`), and a speculator's draft for the token in flight rides behind it
(its first token is a guess at that token: when the guess is wrong the rows after the first are wasted,
nothing else). So the host's work on step N (verifying, detokenizing, streaming) overlaps step N + 1 on
the device. Otherwise step N is settled first and step N + 1 planned from the host's tokens.

`run_once()` is one turn of the loop (its steps planned by step_planner.py); the server runs it in the
scheduler's thread (`start()`), `generate()` in its caller's. Requests come in through `submit()` from any
thread; results go out through the `emit` callback given with each request. Slot i uses KV sequence i of the
runner.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from specserve.engine import step_trace
from specserve.engine.draft_gate import DraftGate, TreeValue
from specserve.engine.kv_room import KVMemory, most_blocks
from specserve.engine.runner import Runner
from specserve.engine.sampling import Sampler
from specserve.engine.slot_drafts import ChainFactory, DraftPolicy
from specserve.engine.slot_jobs import JobQueue, JobWork
from specserve.engine.slot_results import Settler
from specserve.engine.slots import GENERATING, READING, SchedulerCounters, Slot, SlotState, reusable
from specserve.engine.step_plan import Entry, InFlight, Plan
from specserve.engine.step_planner import StepPlanner
from specserve.engine.tasks import Event, Failure, Task, TaskHandle, check_task
from specserve.engine.text_stream import TextStream
from specserve.errors import SpecserveError
from specserve.gguf.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class Scheduler:
    """Serves up to n_slots tasks at once over one Runner."""

    def __init__(self, runner: Runner, tokenizer: Tokenizer, *, chain_factory: ChainFactory | None = None,
                 n_batch: int = 512, overlap: bool = True, adaptive_drafts: bool = True, n_slots: int | None = None,
                 chain_drafts: bool = True, host_cache_bytes: int = 0, prefix_cache: bool = True):
        """chain_factory builds a slot's speculators (None: requests cannot speculate). overlap=False settles every step
        before the next is planned (the reference the tests compare with). adaptive_drafts: slots draft only
        while drafting measurably pays (draft_gate.py); False: whenever a speculator has a draft. n_slots: the
        runner's first sequences are slots (default all). chain_drafts: with more busy slots than the gate
        weighs (draft_gate.MAX_DRAFTING_SLOTS), slots draft in chained steps (the next step assumes the draft
        accepted); False: they do not draft. host_cache_bytes: caches the pool gives up are kept in host memory
        up to this (host_cache.py; 0: none, -1: no limit). prefix_cache: prompts take cached blocks of other
        slots' and earlier tasks' tokens (kv_room.py); False: only their own slot's cache."""
        if n_batch < 1:
            raise SpecserveError(f"batch size must be at least 1, got {n_batch}")
        self.runner = runner
        self.tokenizer = tokenizer
        self.chain_factory = chain_factory
        self.n_batch = n_batch
        self.overlap = overlap
        self.n_ctx = runner.n_ctx
        n_slots = n_slots or runner.n_seqs
        if not 1 <= n_slots <= runner.n_seqs:
            raise SpecserveError(f"{n_slots} slots do not fit a runner of {runner.n_seqs} sequences")
        self.slots = [Slot(i) for i in range(n_slots)]
        self.counters = SchedulerCounters(kv_capacity=runner.ledger.kv_size)  # kv_tokens: counters_snapshot
        self._queue: deque[TaskHandle] = deque()
        self._cond = threading.Condition()
        self.memory = KVMemory(runner, self.slots, self.counters, self._cond, n_batch, host_cache_bytes, prefix_cache)
        self.jobs = JobQueue(runner, self.slots, self._cond, self.memory, lambda: self._stopping)  # (slot_jobs.py)
        self._stopping = False
        self._in_flight: InFlight | None = None
        self.settler = Settler(runner, tokenizer, self.slots, self.counters, self._cond,
                               self.memory.cache_settled)  # (slot_results.py)
        self.drafting = DraftPolicy(runner, self.n_ctx, chain_factory, DraftGate() if overlap and adaptive_drafts
                                    else None, chain_drafts, self.settler.fail)
        self.settler.drafting = self.drafting
        self.planner = StepPlanner(runner, self.slots, self.memory, self.drafting,
                                   most_blocks(n_batch, n_slots, runner.ledger.blocks.block_size))
        self._thread = threading.Thread(target=self._loop, name="specserve-scheduler", daemon=True)
        # Called on the loop's thread after each turn and after the drain (the engine core's process sends the
        # turn's events then, as one message)
        self.after_turn: Callable[[], None] | None = None

    # -- public, thread-safe ---------------------------------------------------------------------

    def start(self) -> None:
        """Run the loop in a thread of its own (the server); otherwise the caller calls run_once()."""
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, task: Task, emit: Callable[[Event], None]) -> TaskHandle:
        """Queue a task; events go to `emit` (called from the thread that runs the loop)."""
        check_task(task, self.n_ctx, speculates=self.chain_factory is not None)
        handle = TaskHandle(task, emit, self._wake)
        with self._cond:
            if self._stopping:
                raise SpecserveError("the server is shutting down")
            self._queue.append(handle)
            self.counters.requests_deferred = len(self._queue)
            self._cond.notify_all()
        return handle

    def submit_job(self, work: JobWork, slot: int | None = None) -> Future[Any]:
        """Run work(slot) on the scheduler's thread once `slot` (None: any slot) is idle (slot_jobs.py)."""
        return self.jobs.submit(work, slot)

    def slots_json(self) -> list[dict[str, object]]:
        with self._cond:
            return [s.to_json(self.n_ctx) for s in self.slots]

    def counters_snapshot(self) -> SchedulerCounters:
        with self._cond:
            c = self.counters.copy()
        blocks = self.runner.ledger.blocks  # derived when asked, not kept up per step
        c.kv_tokens = blocks.used * blocks.block_size
        c.kv_cached_tokens = blocks.n_cached * blocks.block_size
        host = self.memory.host_cache
        c.host_cache_bytes = host.bytes if host is not None else 0
        return c

    @property
    def busy(self) -> bool:
        return (bool(self._queue) or self.jobs.pending or any(s.handle is not None for s in self.slots)
                or self._in_flight is not None)

    # -- the loop ---------------------------------------------------------------------------------

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self.busy:
                    self.drafting.pause()
                    self._cond.wait()
                if self._stopping:
                    break
            self.run_once()
            if self.after_turn is not None:
                self.after_turn()
        self._drain("the server is shutting down")
        if self.after_turn is not None:
            self.after_turn()

    def run_once(self) -> None:
        """One turn: drop cancelled tasks, start queued ones on free slots, launch and settle steps."""
        for slot in self.slots:  # (outside the lock: ending a speculator may write its cache file)
            if slot.handle is not None and slot.handle.cancelled:
                self.settler.finish(slot, "cancelled")
        if self._in_flight is None and self.jobs.pending:  # before queued tasks take the idle slots
            self.jobs.run()
        with self._cond:
            started = self._admit()
        for handle in started:
            self._start_task(handle)
        try:
            self._turn()
        except Exception as exc:  # a lost remote host, or a bug in the step itself: fail the active tasks
            if not isinstance(exc, SpecserveError):
                log.exception("scheduler step failed")
            self._in_flight = None
            message = str(exc) if isinstance(exc, SpecserveError) else f"internal error: {exc}"
            for slot in self.slots:
                if slot.handle is not None:
                    self.settler.fail(slot, message)

    def _turn(self) -> None:
        generating = sum(s.state is GENERATING for s in self.slots)
        self.drafting.begin_turn(generating, self.counters.requests_processing)
        if generating > 1:
            with self._cond:
                if self.drafting.allowed:
                    self.counters.turns_drafting += 1
                else:
                    self.counters.turns_plain += 1
        if self._in_flight is None:
            self._in_flight = self._launch(self.planner.plan(None))
            if self._in_flight is None:
                return
        current = self._in_flight
        live = current.live()
        self._in_flight = self._launch(self.planner.plan(live)) if self.overlap and self._chainable(live) else None
        # While the device works: the speculators' bookkeeping. Skipped while no slot may draft and while drafts
        # are chained (a slot drafts every few steps there): the next draft catches up, and with many slots the
        # host is what limits a step.
        for entry in live if self.drafting.allowed and not self.drafting.chained else ():
            slot = entry.slot
            if not entry.prompt and slot.use_chain and slot.chain is not None and slot.runs(entry.task_id):
                try:
                    slot.chain.prepare(slot.cache)
                except Exception as exc:
                    self.drafting.failed(slot, exc)
        # An unchained step (a draft to verify) leaves the device idle until the next is planned: plan and
        # launch it before handing out this step's events, whose readers would hold the GIL meanwhile.
        self.settler.outbox = []
        try:
            self.settler.settle(current, live)
            if self._in_flight is None and self.overlap and not (self.jobs.pending and self.jobs.ready()):
                self._in_flight = self._launch(self.planner.plan(None))
        finally:
            outbox, self.settler.outbox = self.settler.outbox, None
            for handle, event in outbox:
                handle.emit(event)
            if step_trace.TRACE is not None:
                step_trace.TRACE.mark(current.trace, "emitted")

    def _admit(self) -> list[TaskHandle]:
        """(Under the lock.) Drop cancelled queued tasks; pop as many queued tasks as there are idle slots."""
        for handle in [h for h in self._queue if h.cancelled]:
            handle.emit(Failure("cancelled while waiting for a slot"))
        self._queue = deque(h for h in self._queue if not h.cancelled)
        n_idle = sum(s.handle is None for s in self.slots)
        started = [self._queue.popleft() for _ in range(min(n_idle, len(self._queue)))]
        for handle in started:  # reserve the slots now so /slots and the counters are right at once
            slot = self.memory.pick_slot(handle.task)
            slot.handle, slot.state = handle, SlotState.PROMPT
        self.counters.requests_deferred = len(self._queue)
        self.counters.requests_processing = sum(s.handle is not None for s in self.slots)
        return started

    def _drain(self, message: str) -> None:
        with self._cond:
            for slot in self.slots:
                if slot.handle is not None:
                    self.settler.fail(slot, message)
            while self._queue:
                self._queue.popleft().emit(Failure(message))
            self.jobs.fail_all(message)

    # -- task start ----------------------------------------------------------------------------------

    def _start_task(self, handle: TaskHandle) -> None:
        slot = next(s for s in self.slots if s.handle is handle)
        task = handle.task
        try:
            keep = reusable(slot, task) if task.cache_prompt else 0
            # Evaluate at least one token (its logits start generation); keep no more than the runner still has
            # (a remote host that restarted has lost every cache).
            keep = min(keep, len(task.prompt) - 1, self.runner.seq_len[slot.id])
            self.memory.give_up(slot, keep)
            if slot.adapters != task.adapters:  # (keep is 0: the slot's cache was another adapter mix's)
                self.runner.set_adapter_scales(slot.id, task.adapters)
                slot.adapters = task.adapters
            slot.cache_salt = task.cache_salt
            if task.cache_prompt:
                keep = self.memory.attach_cached(slot, task.prompt, keep)
                keep = self.memory.from_host(slot, task.prompt, keep)
            self.runner.kv_truncate(slot.id, keep)
            slot.cache = task.prompt[:keep]
            slot.replay = []
            slot.n_past = slot.n_planned = slot.n_cached = keep
            slot.n_decoded = slot.n_steps = slot.draft_n = slot.draft_accepted = 0
            slot.draft_room = task.spec.n_max
            slot.draft_surplus = 0.0
            slot.tree_value = TreeValue()
            slot.last = -1
            slot.t_start = time.perf_counter()
            slot.sampler = Sampler(task.sampling)
            slot.sampler.reset(task.prompt)
            slot.note_task_kind()
            slot.stream = TextStream(self.tokenizer, task.stop, task.keep_special)
            self.drafting.prepare_chain(slot, task.spec)
            if task.prediction:
                self.drafting.attach_prediction(slot, task.prediction)
            slot.use_chain = slot.chain is not None and task.spec.n_max > 0
            members = slot.chain.members if slot.chain is not None else []
            slot.spec_base = {m.name: (m.stats.gen_tokens, m.stats.acc_tokens) for m in members}
        except Exception as exc:
            log.exception("could not start task %d", task.id)
            self.settler.fail(slot, str(exc) if isinstance(exc, SpecserveError) else f"internal error: {exc}")

    # -- planning --------------------------------------------------------------------------------------

    def _chainable(self, live: list[Entry]) -> bool:
        """Whether the next step can be queued before the step in flight (its live entries) is read: each slot
        in it needs only argmax and carries no draft (a step's first token at a known position). A slot the step
        ends for sure takes no row in the next step (`Entry.ends`) and does not hold the others back."""
        if not live and not self._queue and not any(s.state in READING
                                                    for s in self.slots):
            return False
        if self.jobs.pending and self.jobs.ready():  # let it run at the next turn, with no step in flight
            return False
        for e in live:
            if e.prompt and not e.final:
                continue
            if not e.slot.greedy_only or e.n_rows != 1 and not e.prompt and not self.drafting.chained:
                return False
            if e.tree is not None:  # (no one path through it for the next step to continue)
                return False
        return True

    def _launch(self, plan: Plan) -> InFlight | None:
        if not plan.entries:
            return None
        try:
            need_logits = any(e.n_logits and not e.slot.greedy_only for e in plan.entries)
            t_launch = step_trace.TRACE.launching() if step_trace.TRACE is not None else 0.0
            step = self.runner.launch(plan.batch, plan.fed_rows(), logits=need_logits)
        except Exception as exc:
            log.exception("forward pass failed")
            for e in plan.entries:
                if e.slot.handle is not None:
                    self.runner.kv_truncate(e.slot.id, 0)
                    e.slot.cache = []
                    why = str(exc) if isinstance(exc, SpecserveError) else f"forward pass failed: {exc}"
                    self.settler.fail(e.slot, why)
            return None
        with self._cond:
            self.counters.n_decode += 1
            self.counters.n_busy_slots += len(plan.entries)
        trace = -1 if step_trace.TRACE is None else step_trace.TRACE.launched(
            t_launch, len(plan.batch), any(e.draft or e.guess is not None for e in plan.entries),
            any(e.prompt for e in plan.entries))
        return InFlight(step, plan.entries, trace)
