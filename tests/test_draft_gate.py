"""DraftGate: drafting is allowed while it gives more tokens per second than not drafting, measured per
count of generating slots, with the other choice tried again now and then."""

from __future__ import annotations

import pytest

from specserve.engine import draft_gate
from specserve.engine.draft_gate import EXPLORE_EVERY, WINDOW, DraftGate


def simulate(monkeypatch: pytest.MonkeyPatch, gate: DraftGate, n_slots: int, turns: int,
             tokens: dict[bool, int], seconds: dict[bool, float]) -> list[bool]:
    """Run turns where a turn with drafts (True) or without gives tokens[mode] in seconds[mode]."""
    clock = [0.0]
    monkeypatch.setattr(draft_gate.time, "perf_counter", lambda: clock[0])
    choices = []
    for _ in range(turns):
        mode = gate.allow(n_slots)
        choices.append(mode)
        gate.count(tokens[mode])
        clock[0] += seconds[mode]
    return choices


def test_keeps_drafting_where_it_pays_and_stops_where_it_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = DraftGate()
    # Four slots: a turn with drafts gives 8.8 tokens in 1.1 ms, without 4 tokens in 1.0 ms: drafting wins.
    one = simulate(monkeypatch, gate, 4, 40 * WINDOW, {True: 88, False: 40}, {True: 0.011, False: 0.010})
    # Eight slots: drafts cost the overlap: 10 tokens in 12 ms with, 8 in 8 ms without.
    many = simulate(monkeypatch, gate, 8, 40 * WINDOW, {True: 10, False: 8}, {True: 0.012, False: 0.008})
    settled = slice(4 * WINDOW, None)  # after both have been measured
    assert sum(one[settled]) / len(one[settled]) > 0.85
    assert sum(many[settled]) / len(many[settled]) < 0.15
    # The other choice is tried again, a window at a time, every EXPLORE_EVERY windows or so.
    tried = [i for i in range(4 * WINDOW, len(many), WINDOW) if many[i]]
    assert tried and all(b - a >= EXPLORE_EVERY * WINDOW for a, b in zip(tried, tried[1:], strict=False))


def test_idle_time_is_not_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = DraftGate()
    clock = [0.0]
    monkeypatch.setattr(draft_gate.time, "perf_counter", lambda: clock[0])
    for turn in range(3 * WINDOW):
        mode = gate.allow(2)
        gate.count(20 if mode else 10)
        clock[0] += 0.01
        if turn == WINDOW + 2:  # a long pause with drafts off: without pause() it would look very slow
            gate.pause()
            clock[0] += 100.0
    bucket = gate._buckets[2]
    assert bucket.rates[True] == pytest.approx(2000) and bucket.rates[False] == pytest.approx(1000)


def test_a_lone_slot_always_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = DraftGate()
    assert all(simulate(monkeypatch, gate, 1, 10 * WINDOW, {True: 1, False: 50}, {True: 1.0, False: 0.001}))


def test_many_slots_never_draft(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above MAX_DRAFTING_SLOTS the windows misjudge (H200: drafting chosen, wall clock lost): no drafts,
    even where a window would say they pay."""
    gate = DraftGate()
    n = draft_gate.MAX_DRAFTING_SLOTS + 1
    assert not any(simulate(monkeypatch, gate, n, 10 * WINDOW, {True: 900, False: 10}, {True: 0.01, False: 0.01}))
    assert not gate._buckets  # nothing measured there


def test_draft_cap_shares_rows_among_many_slots_and_leaves_few_alone() -> None:
    assert draft_gate.draft_cap(1) >= 16 and draft_gate.draft_cap(4) >= 16  # llama.cpp's default --draft-max
    assert draft_gate.draft_cap(64) * 64 <= draft_gate.DRAFT_ROWS
    assert draft_gate.draft_cap(1000) == draft_gate.MIN_DRAFT


def test_a_slots_draft_room_follows_its_acceptance() -> None:
    """Whole drafts accepted: the next may be twice as long (up to n_max); a draft rejected partway: one token
    past what was right (a CPU) or half the room, never less (a GPU), and never below MIN_DRAFT."""
    from specserve.engine.draft_gate import MIN_DRAFT, next_room

    assert next_room(16, 16, 16, 16) == 16
    assert next_room(4, 4, 4, 16) == 8 and next_room(8, 3, 3, 16) == 16  # a short whole draft: room grows
    assert next_room(16, 10, 5, 16) == 6 and next_room(16, 10, 0, 16) == MIN_DRAFT
    assert next_room(16, 10, 5, 16, halve=True) == 8 and next_room(16, 12, 11, 16, halve=True) == 12
    assert next_room(1 << 30, 3, 0, 16, halve=True) == 8  # a slot's first room is unbounded: halved from n_max
    for halve, misses in ((False, 1), (True, 4)):  # a slot that keeps missing
        room = 16
        for _ in range(misses):
            room = next_room(room, room, 0, 16, halve=halve)
        assert room == MIN_DRAFT
        for drafted, accepted in [(2, 2), (4, 4), (8, 8)]:
            room = next_room(room, drafted, accepted, 16, halve=halve)
        assert room == 16  # back to full length after three whole drafts
