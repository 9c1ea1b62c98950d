"""Planning a step: which rows each active slot adds to the next Batch (engine/step_plan.py's Plan).

Generating slots first, one row each (a row fed from the step in flight's argmax where that step is chained,
else the host's last token) and their drafts; then prompt chunks (kv_room.py's plan_reading). Rows take free KV
blocks as they are added; where a generating slot finds none, running slots are preempted, youngest first.
"""

from __future__ import annotations

from specserve.engine import step_trace
from specserve.engine.kv_room import KVMemory, KVRoom
from specserve.engine.runner import Runner
from specserve.engine.slot_drafts import DraftPolicy
from specserve.engine.slots import GENERATING, READING, Slot
from specserve.engine.step_plan import Entry, Plan
from specserve.model.token_tree import TokenTree


class StepPlanner:
    """The scheduler's planner: it reads the slots and the drafting policy and plans within the pool's memory."""

    def __init__(self, runner: Runner, slots: list[Slot], memory: KVMemory, drafting: DraftPolicy, most: int):
        """most: more KV blocks than any step takes (kv_room.most_blocks)."""
        self.runner, self.slots, self.memory, self.drafting = runner, slots, memory, drafting
        self.n_ctx, self.most_blocks = runner.n_ctx, most

    def plan(self, in_flight: list[Entry] | None) -> Plan:
        """The next step. With a step in flight (chainable; its live entries), its slots continue from its
        argmax. Rows take free KV blocks as they are added (kv_room.py); with no step in flight, running slots
        are preempted where a generating slot or, with none generating, every reading one finds no room."""
        while (plan := self._plan_once(in_flight)) is None:  # (each pass preempted a running slot)
            pass
        return plan

    def _plan_once(self, in_flight: list[Entry] | None) -> Plan | None:
        """One planning pass; None where it preempted a running slot for reading ones and the step must be
        planned again."""
        if step_trace.TRACE is not None:
            step_trace.TRACE.planning()
        self.memory.spill_given_up(self.most_blocks)
        room = KVRoom(self.runner.ledger.blocks, self.most_blocks)
        settling = [e for e in in_flight or () if not e.prompt or e.final]  # their next token is in flight
        fed = [e for e in settling if not e.ends(self.n_ctx)]
        chained = {e.slot.id for e in settling}
        decoding = [s for s in self.slots
                    if s.state is GENERATING and s.handle is not None and s.id not in chained]
        starved = self.memory.reserve(room, [(e.slot, e.fed_position) for e in fed]
                                + [(s, len(s.cache)) for s in decoding])
        while starved:
            if in_flight is not None:
                return Plan()  # settle the step in flight first; then this may preempt
            victim = self.memory.preempt_youngest()
            if victim is None:  # (no running slot holds KV, so none should starve): they wait
                decoding = [s for s in decoding if s not in starved]
                break
            decoding = [s for s in decoding if s is not victim]
            room = KVRoom(self.runner.ledger.blocks, self.most_blocks)
            starved = self.memory.reserve(room, [(s, len(s.cache)) for s in decoding])
        plan = Plan()
        # Every draft of the step asked at once: e continues slot.last, one position past it taken by e's argmax.
        # A slot whose step in flight carries a draft drafts again only once that draft is verified.
        drafts: dict[int, list[int] | TokenTree | None] = {}
        if self.drafting.allowed:
            drafts = self.drafting.drafts([(e.slot, e.slot.n_decoded + 1, 1) for e in fed
                                   if not e.prompt and e.n_rows == 1] + [(s, s.n_decoded, 0) for s in decoding])
        for e in fed:
            self._plan_fed(plan, e, drafts.get(e.slot.id, []), room)
        for slot in decoding:
            self._plan_decode(plan, slot, drafts.get(slot.id, []), room)
        reading = [s for s in self.slots if s.state in READING
                   and s.handle is not None and s.id not in chained]
        if reading:
            self.memory.plan_reading(plan, reading, room)
        # (with no step in flight nothing is chained: `reading` holds every reading slot)
        if not plan.entries and in_flight is None and reading and self.memory.preempt_youngest() is not None:
            return None  # every reading slot waits for room that only a running one can give: plan again
        return plan

    def _plan_decode(self, plan: Plan, slot: Slot, draft: list[int] | TokenTree | None, room: KVRoom) -> None:
        """[last, *draft] from the host's tokens, or a token tree rooted at last (draft None: drafting failed the
        slot's task); the draft cut to the pool's room (the first row's blocks are taken already)."""
        position = len(slot.cache)
        if isinstance(draft, TokenTree):
            plan.add_tree(slot, position, draft.cut(room.grow(slot.id, position, 1, len(draft))))
        elif draft is not None:
            draft = draft[:room.grow(slot.id, position, 1, 1 + len(draft)) - 1]
            plan.add_decode(slot, position, slot.last, draft)

    def _plan_fed(self, plan: Plan, e: Entry, draft: list[int] | TokenTree | None, room: KVRoom) -> None:
        """Rows continuing e's slot from e's argmax: [that token, *draft[1:]], draft[0] a guess at it (the draft
        continues slot.last; None: drafting failed the slot's task)."""
        slot = e.slot
        position = e.fed_position
        if e.prompt or e.n_rows > 1:  # the first generated token comes from the prompt's last logit row
            plan.add_decode(slot, position, 0, [], fed_row=e.last_logit_row)
        elif draft is not None:
            assert not isinstance(draft, TokenTree)  # (a fed slot's draft continues a token not yet known)
            guess, rest = (draft[0], draft[1:]) if draft else (None, [])
            rest = rest[:room.grow(slot.id, position, 1, 1 + len(rest)) - 1]
            plan.add_decode(slot, position, 0, rest, fed_row=e.last_logit_row, guess=guess)

