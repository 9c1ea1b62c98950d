"""Planning a step within the paged KV pool.

A step's rows take free blocks as the plan adds them (`KVRoom`): first one row for every generating slot (they
hold KV, and only their progress gives it back), then drafts and prompt chunks from what is left (a new prompt
only where all of it fits: `KVMemory.plan_reading`). Short of
blocks, the scheduler gives up idle slots' prompt caches first, least recently used first; if a generating slot
still finds no room, running slots are preempted, youngest first (vLLM's recompute policy): a preempted slot
gives back its KV and, when room returns, reads its tokens again (`SlotState.RESUMING`) and goes on where it
stopped. Its client only sees a pause. Preemption happens only while no step is in flight.

The pool also keeps prompt prefixes beyond the slots' own caches: sequences past the slots (`HeldPrefix`) take
over, by sharing its blocks, a cache that a slot gives up for another prompt, so a later request with that
prefix (a conversation's next turn, another tenant's system prompt) reads only the rest. They are the first
given up under pressure, least recently used first, beside idle slots' caches.
"""

from __future__ import annotations

import logging
import math
import threading
import time

from specserve.engine.draft_gate import DRAFT_ROWS, MIN_DRAFT
from specserve.engine.host_cache import HostCache
from specserve.engine.runner import Runner
from specserve.engine.slots import HeldPrefix, SchedulerCounters, Slot, SlotState, reusable
from specserve.engine.step_plan import Plan
from specserve.engine.tasks import Task
from specserve.errors import NotSupported
from specserve.model.kv_blocks import BlockTable
from specserve.model.kv_ledger import KVCacheFull

log = logging.getLogger(__name__)

MIN_SHARED_PREFIX = 16  # prompt tokens another slot must add over a slot's own cache to be shared from
# Context positions over which a prompt row's cost doubles (attention reads them all): on the H100 a 512-row prompt
# step took 11 us a row near position 0 and 26.6 at ~3k (docs/perf.md, the long-prompt mix).
ROW_COST_CONTEXT = 2048
MIN_CHUNK = 16  # prompt rows a reading slot gets in a step with decode rows, whatever they cost
# What such a step's prompt rows may cost, in n_batch rows near position 0: on the H100 a 256-row chunk at ~3k
# positions (1.26 n_batch) kept the long-prompt mix's ITL p99 at 14.4 ms; 1.5 trades a little of that for TTFT
MIXED_STEP_COST = 1.5


def prompt_cost(start: int, n: int) -> float:
    """A chunk of n prompt rows from position `start`, in rows near position 0."""
    return n * (1 + (start + n / 2) / ROW_COST_CONTEXT)


def prompt_rows_within(cost: float, start: int) -> int:
    """The most prompt rows from position `start` whose prompt_cost is at most `cost` (a root of its quadratic)."""
    a = 1 + start / ROW_COST_CONTEXT
    n = int(ROW_COST_CONTEXT * (math.sqrt(a * a + 2 * cost / ROW_COST_CONTEXT) - a))
    return n - 1 if n > 0 and prompt_cost(start, n) > cost else n


def most_blocks(n_batch: int, n_slots: int, block_size: int) -> int:
    """More blocks than any step can take: at most n_batch prompt rows, a row and a draft of draft_cap per slot
    (DRAFT_ROWS in all, or MIN_DRAFT each) and a guess, and per slot's run two blocks past its rows' own (a
    start mid-block, and a copy of a shared one)."""
    rows = n_batch + max(DRAFT_ROWS, MIN_DRAFT * n_slots) + 2 * n_slots
    return rows // block_size + 2 * n_slots + 2


class KVRoom:
    """The free blocks left to the step being planned. With more free than any step takes (`most_blocks`), the
    rows are not counted: the step path pays for the pool's accounting only when it is nearly full."""

    def __init__(self, blocks: BlockTable, most: int):
        self.blocks = blocks
        self.free = blocks.free
        self.plenty = self.free >= most

    def grow(self, seq: int, start: int, have: int, want: int) -> int:
        """A sequence's rows from position `start` on, `have` of them already taken: how many of `want` fit
        (taking their blocks)."""
        if self.plenty:
            return want
        base = self.blocks.need(seq, start, start + have)
        n = min(want, self.blocks.positions_within(seq, start, self.free + base))
        self.free -= self.blocks.need(seq, start, start + n) - base
        return n


class KVMemory:
    """The pool's memory as the scheduler plans with it: room for a step's rows, idle caches given up under pressure
    (to the host tier where there is one), running slots preempted, and prompt prefixes shared, held and read back.
    It shares the scheduler's slots, held prefixes, counters and lock."""

    def __init__(self, runner: Runner, slots: list[Slot], held: list[HeldPrefix], counters: SchedulerCounters,
                 lock: threading.Condition, n_batch: int, host_cache_bytes: int = 0):
        self.runner, self.slots, self.held, self.counters = runner, slots, held, counters
        self._cond, self.n_batch = lock, n_batch
        self.host_cache = HostCache(host_cache_bytes) if host_cache_bytes else None  # --cache-ram (host_cache.py)

    def pick_slot(self, task: Task) -> Slot:
        """The idle slot whose cache shares the longest prefix with the prompt, else the least recently used."""
        idle = [s for s in self.slots if s.handle is None]
        if task.cache_prompt:
            best = max(idle, key=lambda s: (reusable(s, task.prompt, task.adapters), -s.last_used))
            if reusable(best, task.prompt, task.adapters) > 0:
                return best
        return min(idle, key=lambda s: s.last_used)

    def evict_idle(self, room: KVRoom, need: int) -> None:
        """Give up held prefixes and idle slots' caches, least recently used first, until `need` blocks are free (a
        cache whose blocks running slots hold too frees nothing, and is kept)."""
        if room.plenty or room.free >= need:
            return
        tables = room.blocks.tables
        busy = {b for s in self.slots if s.handle is not None for b in tables[s.id]}
        idle: list[Slot | HeldPrefix] = [*(s for s in self.slots if s.handle is None), *self.held]
        for seq in sorted((s for s in idle if not busy.issuperset(tables[s.id])), key=lambda s: s.last_used):
            before = room.blocks.free
            self._keep_in_host(seq)
            self.runner.kv_truncate(seq.id, 0)
            seq.cache = []
            room.free += room.blocks.free - before
            if room.free >= need:
                return

    def _keep_in_host(self, seq: Slot | HeldPrefix) -> None:
        """Copy a cache the pool gives up to the host tier (where there is one)."""
        n = min(len(seq.cache), self.runner.seq_len[seq.id])
        if self.host_cache is None or n == 0:
            return
        try:
            kept = self.host_cache.keep(seq.cache[:n], seq.adapters, lambda: self.runner.kv_read(seq.id)[:, :, :, :n])
        except NotSupported as exc:  # (a remote or tensor-parallel runner)
            log.warning("no host prompt cache: %s", exc)
            self.host_cache = None
            return
        if kept:
            with self._cond:
                self.counters.host_cache_kept += 1

    def from_host(self, slot: Slot, prompt: list[int], keep: int) -> int:
        """Where the host tier holds more of the prompt than the slot keeps (its own cache or a shared prefix), write
        that entry's positions into the slot's sequence; the positions the sequence now holds for the prompt."""
        if self.host_cache is None:
            return keep
        n, entry = self.host_cache.best(prompt, slot.adapters)
        n = min(n, len(prompt) - 1)
        if entry is None or n < keep + MIN_SHARED_PREFIX:
            return keep
        self.runner.kv_truncate(slot.id, 0)  # (the entry holds all the slot kept of the prompt, and more)
        blocks = self.runner.ledger.blocks
        self.evict_idle(KVRoom(blocks, most=1 << 62), blocks.need(slot.id, 0, n))
        try:
            self.runner.kv_write(slot.id, entry.kv[:, :, :, :n])
        except KVCacheFull:  # idle caches gave up, still short: the prompt is read
            return 0
        with self._cond:
            self.counters.prompt_tokens_host += n - keep
        return n

    def fit(self, room: KVRoom, seq: int, start: int, want: int) -> int:
        """How many of `want` rows from position `start` fit (taking their blocks), idle caches given up for them
        where the room is short."""
        self.evict_idle(room, 0 if room.plenty else room.blocks.need(seq, start, start + want))
        return room.grow(seq, start, 0, want)

    def plan_reading(self, plan: Plan, reading: list[Slot], room: KVRoom) -> None:
        """Prompt chunks (and preempted slots' tokens read again) of the reading slots share what is left of
        n_batch, but always get a share so they never starve; oldest task first, each as far as the pool allows.
        Where the step carries decode rows, its prompt rows also count by their cost (prompt_cost, at most
        MIXED_STEP_COST n_batch), so that a chunk deep into a long prompt does not make every generating slot wait a
        long step for its token."""
        budget = max(self.n_batch - len(plan.batch), self.n_batch // 4, 1)
        # what the prompt rows may still cost where decode rows share the step (None: they do not)
        cost = max(MIXED_STEP_COST * self.n_batch - len(plan.batch), self.n_batch / 4, 1) if len(plan.batch) else None
        reading = sorted(reading, key=lambda s: s.t_start)
        waiting = False  # a new prompt waits for room: younger new prompts wait behind it (first come, first served)
        generating = sum(s.state is SlotState.GENERATING for s in self.slots)  # a block each, beside a new prompt
        for slot in reading:
            replay = slot.state == SlotState.RESUMING
            tokens = slot.replay if replay else slot.task.prompt
            start = slot.n_planned
            if budget <= 0 or cost is not None and cost <= 0 or start >= len(tokens):
                continue
            # (by cost: still a block's rows a step, however deep into a long prompt)
            affordable = budget if cost is None else max(prompt_rows_within(cost, start), MIN_CHUNK)
            want = min(budget, affordable, len(tokens) - start)
            if not room.plenty and not replay and start == slot.n_cached:
                # A prompt starts only where all of it fits beside a block for each generating slot: one that
                # could not finish would be preempted again and again (its chunks read in vain).
                whole = room.blocks.need(slot.id, start, len(tokens)) + generating
                self.evict_idle(room, whole)
                waiting = waiting or room.free < whole
                if waiting:
                    continue
            n = self.fit(room, slot.id, start, want)
            if n == 0:
                continue
            plan.add_prompt(slot, tokens[start:start + n], start, not replay and start + n == len(tokens), replay)
            slot.n_planned += n
            budget -= n
            if cost is not None:
                cost -= prompt_cost(start, n)

    def reserve(self, room: KVRoom, rows: list[tuple[Slot, int]]) -> list[Slot]:
        """One row at `position` for each slot; the slots that found no room (after idle caches went)."""
        if room.plenty:
            return []
        return [slot for slot, position in rows if self.fit(room, slot.id, position, 1) == 0]

    def preempt_youngest(self) -> Slot | None:
        """Preempt the most recently started running slot that holds KV (None: no slot does)."""
        holding = [s for s in self.slots if s.handle is not None and self.runner.seq_len[s.id] > 0]
        if not holding:
            return None
        victim = max(holding, key=lambda s: s.t_start)
        self.preempt(victim)
        return victim

    def preempt(self, slot: Slot) -> None:
        """Give back a running slot's KV; it reads what it held again when room returns."""
        if slot.state == SlotState.GENERATING:
            slot.replay = slot.cache
            slot.state = SlotState.RESUMING
        elif slot.state == SlotState.PROMPT:
            slot.n_past = slot.n_cached = 0
        slot.n_planned = 0
        slot.cache = []
        self.runner.kv_truncate(slot.id, 0)
        with self._cond:
            self.counters.kv_preemptions += 1

    def share_prefix(self, slot: Slot, prompt: list[int], keep: int) -> int:
        """Where another slot's cache or a held prefix holds more of the prompt than this slot's own (a shared system
        prompt, a conversation's earlier turns), take that sequence's blocks (kv_copy: held once, copied on write)
        instead of evaluating the prefix again; the caller truncates to the returned length. Only settled positions
        count (slot.cache), so a step in flight on the other slot cannot matter."""
        others: list[Slot | HeldPrefix] = [*(s for s in self.slots if s is not slot), *self.held]
        held, best = max(((reusable(s, prompt, slot.adapters), s) for s in others), key=lambda pair: pair[0],
                         default=(0, slot))
        shared = min(held, len(prompt) - 1, self.runner.seq_len[best.id])
        if shared < keep + MIN_SHARED_PREFIX:
            return keep
        self.runner.kv_copy(best.id, slot.id)
        best.last_used = time.perf_counter()
        with self._cond:
            self.counters.prompt_tokens_shared += shared - keep
        return shared

    def hold_prefix(self, slot: Slot, keep: int) -> None:
        """Before an idle slot keeps only `keep` of its cache for a new prompt: have a held prefix take over the
        rest (its blocks shared), unless another sequence holds it already or it is short."""
        tokens = slot.cache[:self.runner.seq_len[slot.id]]
        if not self.held or len(tokens) < keep + MIN_SHARED_PREFIX:
            return
        others: list[Slot | HeldPrefix] = [*(s for s in self.slots if s is not slot), *self.held]
        if any(reusable(s, tokens, slot.adapters) == len(tokens) for s in others):
            return
        # the sequence it extends (it adds to that prefix), else an empty one, else the least recently used
        spare = max(self.held, key=lambda h: (reusable(h, tokens, slot.adapters) == len(h.cache) > 0, not h.cache,
                                              -h.last_used))
        self.runner.kv_copy(slot.id, spare.id)
        self.runner.kv_truncate(spare.id, len(tokens))
        spare.cache, spare.last_used, spare.adapters = list(tokens), time.perf_counter(), slot.adapters
