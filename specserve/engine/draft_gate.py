"""Whether the scheduler lets its slots draft right now: speculation that never loses.

A step with a draft must be settled before the next is planned, so drafting trades the overlap of host and
device for the accepted tokens. With one slot that trade pays twice over on edited code; with dozens of
slots the host's work per step is what limits throughput and a few accepted tokens do not buy back the lost
overlap. Which side wins depends on the model, the device, the load and the text, so it is measured on the
live load: generated tokens per second over windows of turns with drafts and without, per power-of-two
count of busy slots (generating or reading a prompt: an unchained turn holds back prompt chunks as well), with a
window of the other choice now and then to keep both figures fresh.
A lone slot always drafts (on the code edits it gains x2 through the server). Every turn is measured,
prompt chunks too: drafting spreads the ends of requests, so later prompts arrive one by one into
unchained turns, and that cost belongs to the choice.

Above MAX_DRAFTING_SLOTS busy slots the gate does not decide. There the windows misjudge: a window's rate
cannot see what drafting does to later turns, and on the H200 the gate let 64 slots draft in 68-81% of
turns while the wall clock lost 20-35% (docs/perf.md). `--draft-policy always` drafts regardless.

Past MAX_DRAFTING_SLOTS busy slots, drafts ride chained steps instead: the step queued after a drafted one
assumes the draft accepted whole, and a slot whose drafts give less than plain steps would (`chained_surplus`)
stops drafting for a while (the scheduler's `chain_drafts`; `--draft-policy gated` turns it off).

With many slots the drafts of one step are also capped (`draft_cap`): a verify step's rows grow with the
sum of all drafts, and a few drafted tokens per slot keep most of the gain at a fraction of the rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

WINDOW = 8  # turns per measured window
EXPLORE_EVERY = 16  # windows of the better choice between two windows of the other
SMOOTHING = 0.5  # weight of the newest window in a rate
DRAFT_ROWS = 128  # draft rows of one step, shared by the generating slots
MIN_DRAFT = 2  # drafts a slot may make however many slots there are
MAX_DRAFTING_SLOTS = 8  # with more busy slots, drafts ride chained steps
SURPLUS_RECOVERY = 0.25  # a slot that stopped drafting (negative surplus) tries again after a few steps


def next_room(room: int, drafted: int, accepted: int, n_max: int, halve: bool = False) -> int:
    """A slot's next draft length limit after a verified draft: a draft accepted whole may be twice as long
    next time. After one rejected partway the room is cut to one token past what was right, or with `halve`
    (where a verify row costs little next to a decode step: a GPU) halved, never below that, so a one-off miss
    in repeating text (a renamed identifier) costs little while a slot that keeps missing is down to MIN_DRAFT
    in a few steps. On a 2-core CPU a wrong draft token costs a fifth of a decode step, and long wrong drafts
    are what kept speculation from paying."""
    if accepted >= drafted:
        return min(n_max, max(room, drafted) * 2)
    return max(MIN_DRAFT, accepted + 1, min(room, n_max) // 2 if halve else 0)


def chained_surplus(surplus: float, gained: int, whole: bool) -> float:
    """A slot's running surplus after one of its chained drafted steps settles. Past MAX_DRAFTING_SLOTS the
    step after a drafted one is queued assuming the draft accepted whole; where it was not, that step's rows
    for the slot are wasted, so a drafted step must give more than the two tokens two plain steps would:
    `gained` tokens, one more from the next step when `whole`."""
    return (1 - SMOOTHING) * surplus + SMOOTHING * (gained + int(whole) - 2)


ROW_COST = {"cuda": 0.02, "cpu": 0.2}  # a verify row's cost in decode steps: a GPU at a few rows, a 2-core CPU
TREE_SMOOTHING = 0.25  # weight of the newest tree in TreeValue's averages
TREE_RETRY = 8  # a slot whose trees did not pay drafts chains, and a tree again every this many drafts


@dataclass
class TreeValue:
    """Whether a slot's token trees pay for their rows: the tokens the other branches gave beyond the first
    candidate's, against the rows they took, averaged over its recent trees. A verify row costs a fraction of a
    decode step (ROW_COST: little on a GPU, a fifth on a 2-core CPU), so on a CPU a tree must win often."""

    gain: float = 0.0  # tokens a tree gave beyond its first candidate alone
    rows: float = 0.0  # rows it took beyond the first candidate's
    skipped: int = 0  # drafts made as chains since the last tree

    def note(self, gained: int, extra_rows: int) -> None:
        self.gain += TREE_SMOOTHING * (gained - self.gain)
        self.rows += TREE_SMOOTHING * (extra_rows - self.rows)
        self.skipped = 0

    def wanted(self, row_cost: float) -> bool:
        """Whether the next draft is a tree (else a chain, counted toward the next try)."""
        if self.gain >= row_cost * self.rows or self.skipped >= TREE_RETRY:
            return True
        self.skipped += 1
        return False


def draft_cap(n_slots: int) -> int:
    """Most tokens one slot may draft in a step while n_slots generate."""
    return max(MIN_DRAFT, DRAFT_ROWS // max(n_slots, 1))


@dataclass
class _Bucket:
    rates: dict[bool, float] = field(default_factory=dict)  # drafts allowed -> tokens/s
    allow: bool = True  # this window's choice
    turns: int = 0
    tokens: int = 0
    seconds: float = 0.0
    windows_since_other: int = 0


class DraftGate:
    def __init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}
        self._last: tuple[_Bucket, float] | None = None  # the turn in progress: its bucket, its start
        self._turn_tokens = 0

    @staticmethod
    def _key(n_slots: int) -> int:
        return max(n_slots, 1).bit_length()

    def allow(self, n_slots: int) -> bool:
        """Called at the start of every turn with the number of busy slots (generating or reading a prompt):
        may the generating ones draft?"""
        now = time.perf_counter()
        self._close(now)
        if n_slots < 2 or n_slots > MAX_DRAFTING_SLOTS:  # one slot: drafts always pay; many: see above
            self.pause()
            return n_slots < 2
        bucket = self._buckets.setdefault(self._key(n_slots), _Bucket())
        self._last = (bucket, now)
        return bucket.allow

    def pause(self) -> None:
        """The loop goes idle: the turn in progress is not measured."""
        self._last = None
        self._turn_tokens = 0

    def count(self, n_tokens: int) -> None:
        """Tokens handed out during the current turn."""
        self._turn_tokens += n_tokens

    def _close(self, now: float) -> None:
        """Account the turn that just ended; at the end of a window, choose the next window's mode."""
        if self._last is None:  # an unmeasured turn: its tokens are not counted either
            self._turn_tokens = 0
            return
        bucket, start = self._last
        bucket.tokens += self._turn_tokens
        self._turn_tokens = 0
        bucket.seconds += now - start
        bucket.turns += 1
        if bucket.turns < WINDOW:
            return
        rate = bucket.tokens / bucket.seconds if bucket.seconds > 0 else 0.0
        old = bucket.rates.get(bucket.allow)
        bucket.rates[bucket.allow] = rate if old is None else SMOOTHING * rate + (1 - SMOOTHING) * old
        bucket.turns, bucket.tokens, bucket.seconds = 0, 0, 0.0
        if len(bucket.rates) < 2:  # not measured both ways yet
            bucket.allow = not bucket.allow
            bucket.windows_since_other = 0
            return
        best = bucket.rates[True] >= bucket.rates[False]
        bucket.windows_since_other += 1
        if bucket.windows_since_other > EXPLORE_EVERY:
            bucket.allow, bucket.windows_since_other = not best, 0
        else:
            bucket.allow = best
