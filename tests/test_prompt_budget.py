"""A step's prompt rows beside decode rows also count by their cost (engine/kv_room.py): deep into a long prompt a
chunk is shorter, so generating slots do not wait a long step for each token; near the start, or with no decode row,
a chunk takes all of n_batch (never more rows); however deep, a reading slot still gets a block's rows a step."""

from __future__ import annotations

import random
import threading
from types import SimpleNamespace
from typing import Any

from specserve.engine.kv_room import MIN_CHUNK, MIXED_STEP_COST, KVMemory, KVRoom, prompt_cost, prompt_rows_within
from specserve.engine.slots import SchedulerCounters, SlotState
from specserve.engine.step_plan import Plan
from specserve.model.kv_blocks import BlockTable

N_BATCH = 512


def test_prompt_rows_within_is_the_most_that_cost_no_more() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        cost, start = rng.uniform(0, 2048), rng.choice([0, 5, 100, 2047, 4096, 50_000, 1_000_000])
        n = prompt_rows_within(cost, start)
        assert n >= 0 and prompt_cost(start, n) <= cost < prompt_cost(start, n + 1)


def _slot(i: int, state: SlotState, prompt: list[int], at: int = 0) -> Any:
    task = SimpleNamespace(id=i, prompt=prompt)
    return SimpleNamespace(id=i, state=state, task=task, handle=SimpleNamespace(task=task), n_planned=at,
                           n_cached=at, t_start=float(i), replay=[], cache=[1] * 8, n_decoded=1)


def _read(at: int, decoding: int) -> int:
    """The prompt rows one reading slot at position `at` of a 100k-token prompt gets beside `decoding` decode rows."""
    reader = _slot(0, SlotState.PROMPT, [3] * 100_000, at)
    generating = [_slot(1 + i, SlotState.GENERATING, [3] * 8) for i in range(decoding)]
    memory = KVMemory(None, [reader, *generating], SchedulerCounters(), threading.Condition(), N_BATCH)  # type: ignore[arg-type]
    plan = Plan()
    for slot in generating:
        plan.add_decode(slot, 8, 5, [])
    memory.plan_reading(plan, [reader], KVRoom(BlockTable(1 + decoding, 1 << 16), most=1))
    return reader.n_planned - at


def test_decode_rows_shorten_a_deep_chunk() -> None:
    assert _read(0, 0) == N_BATCH  # no decode row: all of n_batch
    assert _read(4096, 0) == N_BATCH
    rows = _read(4096, 3)
    assert rows == prompt_rows_within(MIXED_STEP_COST * N_BATCH - 3, 4096) < N_BATCH // 2  # rows read ~4k positions
    near = _read(0, 3)
    assert rows < near == N_BATCH - 3  # near the start: all of n_batch (it never takes more rows)
    assert prompt_rows_within(MIXED_STEP_COST * N_BATCH - 3, 99_000) < MIN_CHUNK == _read(99_000, 3)  # not starved
