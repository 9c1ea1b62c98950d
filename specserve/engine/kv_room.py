"""Planning a step within the paged KV pool.

A step's rows take free blocks as the plan adds them (`KVRoom`): first one row for every generating slot (they
hold KV, and only their progress gives it back), then drafts and prompt chunks from what is left (a new prompt
only where all of it fits: `KVMemory.plan_reading`). Short of
blocks, the scheduler gives up idle slots' prompt caches first, least recently used first; if a generating slot
still finds no room, running slots are preempted, youngest first (vLLM's recompute policy): a preempted slot
gives back its KV and, when room returns, reads its tokens again (`SlotState.RESUMING`) and goes on where it
stopped. Its client only sees a pause. Preemption happens only while no step is in flight.

The pool also keeps prompt prefixes beyond the slots' own caches: a slot names its full blocks by content as its
prompt is read and when its task ends (`cache_settled`, kv_blocks.content_hashes), and a new prompt takes the named
blocks of its longest cached prefix (`attach_cached`: a conversation's next turn, another tenant's system prompt,
another slot's prompt being read), so it reads only the rest. Named blocks that no sequence holds any more stay
cached among the free blocks until the pool needs them, least recently given up first.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable

import torch

from specserve.engine.draft_gate import DRAFT_ROWS, MIN_DRAFT
from specserve.engine.host_cache import HostCache
from specserve.engine.runner import Runner
from specserve.engine.slots import SchedulerCounters, Slot, SlotState, reusable
from specserve.engine.step_plan import Plan
from specserve.engine.tasks import KVKey, Task
from specserve.errors import NotSupported
from specserve.model.kv_blocks import BlockTable, content_hashes
from specserve.model.kv_ledger import KVCacheFull

log = logging.getLogger(__name__)

MIN_SHARED_PREFIX = 16  # prompt tokens cached blocks must add over a slot's own cache to be taken
MAX_GIVEN_UP = 64  # dropped caches noted for the host tier (KVMemory.given_up)
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
    (to the host tier where there is one), running slots preempted, and prompt prefixes cached by content and read
    back. It shares the scheduler's slots, counters and lock. prefix_cache=False: no blocks are named (each prompt
    reuses only its own slot's cache)."""

    def __init__(self, runner: Runner, slots: list[Slot], counters: SchedulerCounters, lock: threading.Condition,
                 n_batch: int, host_cache_bytes: int = 0, prefix_cache: bool = True):
        self.runner, self.slots, self.counters = runner, slots, counters
        self._cond, self.n_batch = lock, n_batch
        self.prefix_cache = prefix_cache
        self.host_cache = HostCache(host_cache_bytes) if host_cache_bytes else None  # --cache-ram (host_cache.py)
        # caches slots dropped for other prompts, oldest first, whose named blocks the pool keeps: what the host tier
        # takes before the pool gives those blocks up (spill_given_up)
        self.given_up: OrderedDict[tuple[int, ...], KVKey] = OrderedDict()
        self._named: dict[int, tuple[KVKey, list[int], list[int]]] = {}  # slot id -> (key, tokens named, names)

    def pick_slot(self, task: Task) -> Slot:
        """The idle slot whose cache shares the longest prefix with the prompt, else the least recently used."""
        idle = [s for s in self.slots if s.handle is None]
        if task.cache_prompt:
            best = max(idle, key=lambda s: (reusable(s, task), -s.last_used))
            if reusable(best, task) > 0:
                return best
        return min(idle, key=lambda s: s.last_used)

    def evict_idle(self, room: KVRoom, need: int) -> None:
        """Give up idle slots' caches, least recently used first, until `need` blocks are free (a cache whose blocks
        running slots hold too frees nothing, and is kept). Their named blocks stay cached until the pool needs them."""
        if room.plenty or room.free >= need:
            return
        tables = room.blocks.tables
        busy = {b for s in self.slots if s.handle is not None for b in tables[s.id]}
        idle = [s for s in self.slots if s.handle is None]
        for seq in sorted((s for s in idle if not busy.issuperset(tables[s.id])), key=lambda s: s.last_used):
            before = room.blocks.free
            self._keep_in_host(seq)
            self.runner.kv_truncate(seq.id, 0)
            seq.cache = []
            room.free += room.blocks.free - before
            if room.free >= need:
                return

    def _keep_in_host(self, seq: Slot) -> None:
        """Copy a cache the pool gives up to the host tier (where there is one)."""
        n = min(len(seq.cache), self.runner.seq_len[seq.id])
        if n:
            self._to_host(seq.cache[:n], seq.kv_key, lambda: self.runner.kv_read(seq.id)[:, :, :, :n])

    def _to_host(self, tokens: list[int], key: KVKey, read: Callable[[], torch.Tensor]) -> None:
        if self.host_cache is None:
            return
        try:
            kept = self.host_cache.keep(tokens, key, read)
        except NotSupported as exc:  # (a remote or tensor-parallel runner)
            log.warning("no host prompt cache: %s", exc)
            self.host_cache = None
            return
        if kept:
            with self._cond:
                self.counters.host_cache_kept += 1

    def give_up(self, slot: Slot, keep: int) -> None:
        """The slot keeps only `keep` positions of its cache for a new prompt: with a host tier, the rest (its named
        blocks, cached by the pool) is noted for spill_given_up."""
        n = min(len(slot.cache), self.runner.seq_len[slot.id]) // self.block_size * self.block_size
        if self.host_cache is not None and self.prefix_cache and n >= keep + MIN_SHARED_PREFIX:
            self.given_up[tuple(slot.cache[:n])] = slot.kv_key
            while len(self.given_up) > MAX_GIVEN_UP:
                self.given_up.popitem(last=False)

    def spill_given_up(self, most: int) -> None:
        """Where the pool is short (fewer free blocks, cached ones counted, than a step can take), copy the oldest
        given-up cache whose blocks are still cached to the host tier: one a step (a copy waits for the device), as
        the pool gives up the blocks given up longest ago first. A pool with room to spare pays nothing here."""
        blocks = self.runner.ledger.blocks
        while self.given_up and blocks.free < most:
            tokens, key = self.given_up.popitem(last=False)
            names = content_hashes(tokens, key, self.block_size)
            n = blocks.cached_run(names) * self.block_size
            if n >= MIN_SHARED_PREFIX:
                self._to_host(list(tokens[:n]), key, functools.partial(self.runner.kv_read_cached, names))
                return

    def from_host(self, slot: Slot, prompt: list[int], keep: int) -> int:
        """Where the host tier holds more of the prompt than the slot keeps (its own cache or a shared prefix), write
        that entry's positions into the slot's sequence; the positions the sequence now holds for the prompt."""
        if self.host_cache is None:
            return keep
        n, entry = self.host_cache.best(prompt, slot.kv_key)
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

    def cache_settled(self, slot: Slot) -> None:
        """Name the full blocks of what the slot holds and has settled (slot.cache) by content, for attach_cached.
        Only blocks past those named last time are hashed, where the slot's tokens still start with those."""
        if not self.prefix_cache:
            return
        n = min(len(slot.cache), self.runner.seq_len[slot.id])
        tokens, key = slot.cache[:n], slot.kv_key
        known: list[int] = []
        last = self._named.get(slot.id)
        if last is not None and last[0] == key and tokens[:len(last[1])] == last[1]:
            known = last[2]
        names = content_hashes(tokens, key, self.block_size, known)
        self._named[slot.id] = (key, tokens[:len(names) * self.block_size], names)
        self.runner.kv_cache(slot.id, names)

    def attach_cached(self, slot: Slot, prompt: list[int], keep: int) -> int:
        """Where cached blocks hold more of the prompt than the slot's own `keep` positions (a shared system prompt,
        a conversation's earlier turns, another slot's prompt), the slot takes them (held once, copied on write)
        instead of evaluating that prefix again; the caller truncates to the returned length."""
        if not self.prefix_cache:
            return keep
        names = content_hashes(prompt, slot.kv_key, self.block_size)
        shared = min(self.runner.ledger.blocks.cached_run(names) * self.block_size, len(prompt) - 1)
        if shared < keep + MIN_SHARED_PREFIX:
            return keep
        self.runner.kv_attach(slot.id, names[:-(-shared // self.block_size)])
        with self._cond:
            self.counters.prompt_tokens_shared += shared - keep
        return shared

    @property
    def block_size(self) -> int:
        return self.runner.ledger.blocks.block_size
