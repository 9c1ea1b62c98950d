"""How the scheduler asks a slot's speculators for a draft: how many tokens it may take, and the draft model
drafting for all the slots of a plan together (one forward per draft token) instead of slot after slot."""

from __future__ import annotations

import logging

from specserve.engine.runner import Runner
from specserve.engine.slots import Slot, SlotState
from specserve.engine.step_plan import Entry
from specserve.speculative.draft_model import prefetch_drafts

log = logging.getLogger(__name__)


class SlotDrafts:
    """The scheduler's drafting (Scheduler provides these attributes)."""

    slots: list[Slot]
    runner: Runner
    n_ctx: int
    _drafts_allowed: bool
    _draft_cap: int

    def _fail(self, slot: Slot, message: str) -> None: ...

    def _draft(self, slot: Slot, history: list[int], last: int, n_decoded: int, ahead: int) -> list[int]:
        """Draft after `last` (at position len(history)); ahead: positions already taken past it (the fed
        token), which the draft's first token stands for."""
        limit = self._draft_limit(slot, history, n_decoded, ahead)
        if limit is None or slot.chain is None:
            return []
        return slot.chain.draft(history, last, limit, slot.task.spec.n_min + ahead)

    def _draft_limit(self, slot: Slot, history: list[int], n_decoded: int, ahead: int) -> int | None:
        """The most tokens `_draft` may ask the slot's speculators for; None where it asks nothing."""
        task = slot.task
        spec = task.spec
        if (not self._drafts_allowed or not slot.use_chain or slot.chain is None or slot.handle is None
                or slot.handle.cancelled):
            return None
        room = self.n_ctx - len(history) - 1  # positions left after `last`
        left = task.n_predict - n_decoded - 1 + ahead if task.n_predict >= 0 else room
        limit = min(self.runner.draft_limit(min(spec.n_max, self._draft_cap, slot.draft_room)) + ahead, left, room)
        return limit if limit >= max(spec.n_min, 1) + ahead else None

    def _prefetch_drafts(self, in_flight: list[Entry] | None) -> None:
        """The draft model drafts for every slot this plan will ask it of in one forward per draft token
        (`prefetch_drafts`), instead of slot after slot."""
        asks: list[tuple[Slot, int, int]] = []  # (slot, n_decoded, ahead) as _plan_fed / _plan_decode pass them
        chained = set()
        for e in in_flight or ():
            if not e.prompt or e.final:
                chained.add(e.slot.id)
                if not e.prompt:
                    asks.append((e.slot, e.slot.n_decoded + 1, 1))
        asks += [(s, s.n_decoded, 0) for s in self.slots
                 if s.state == SlotState.GENERATING and s.handle is not None and s.id not in chained]
        wanted = []
        for slot, n_decoded, ahead in asks:
            limit = self._draft_limit(slot, slot.cache, n_decoded, ahead)
            if limit is not None and slot.chain is not None:
                wanted.append((slot.chain, slot.cache, slot.last, limit))
        try:
            prefetch_drafts(wanted)
        except Exception:  # each slot's own draft() then runs, and fails, on its own
            log.exception("drafting together failed")

    def _drafting_failed(self, slot: Slot, exc: Exception) -> None:
        """A speculator raised (draft or prepare): that slot's task fails, the others go on."""
        log.exception("drafting failed on slot %d", slot.id)
        self._fail(slot, f"speculative drafting failed: {exc}")
