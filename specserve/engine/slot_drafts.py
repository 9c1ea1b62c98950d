"""The scheduler's slots and their speculators: a task's chain (built, reused, or led by its prediction), how many
tokens each slot may draft, and all of a step's asks at once, so that the draft model drafts for them together (one
forward per draft token)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from specserve.engine.draft_gate import (
    DRAFT_ROWS,
    MAX_DRAFTING_SLOTS,
    ROW_COST,
    SURPLUS_RECOVERY,
    DraftGate,
    draft_cap,
)
from specserve.engine.runner import Runner
from specserve.engine.slots import Slot
from specserve.model.token_tree import TokenTree
from specserve.speculative.base import Chain, SpecParams, Speculator, draft_candidates
from specserve.speculative.prediction import PredictionDrafter

log = logging.getLogger(__name__)

ChainFactory = Callable[[SpecParams, int], Chain | None]  # (params, slot id) -> the slot's speculator chain


class DraftPolicy:
    """Which slots draft this turn and how much (the draft gate's verdict, chained drafts under load, each slot's
    draft room), each slot's chain (built, reused, or led by its prediction), and a step's asks drafted together.
    `fail` ends a slot's task when its speculator raises."""

    def __init__(self, runner: Runner, n_ctx: int, chain_factory: ChainFactory | None, gate: DraftGate | None,
                 chain_drafts: bool, fail: Callable[[Slot, str], None]):
        self.runner = runner
        self.n_ctx = n_ctx
        self.chain_factory = chain_factory
        self._gate = gate
        self._chain_under_load = chain_drafts and gate is not None
        self._fail = fail
        self.allowed = True  # this turn: slots may draft
        self.chained = False  # this turn: drafted steps are chained (busy slots past MAX_DRAFTING_SLOTS)
        self._turn = 0  # steps drafted for (the chained drafts' rotation)
        self._cap = draft_cap(1)
        self._row_cost = ROW_COST.get(runner.device.type, ROW_COST["cpu"])

    def begin_turn(self, generating: int, busy: int) -> None:
        """A turn with `generating` slots generating and `busy` slots busy (prompt readers too: a drafting turn
        unchains their chunks)."""
        self._cap = draft_cap(generating)
        if self._gate is not None:
            self.allowed = self._gate.allow(busy)
            self.chained = self._chain_under_load and busy > MAX_DRAFTING_SLOTS
            self.allowed |= self.chained

    def count(self, tokens: int) -> None:
        """A slot's settled tokens, for the gate's rate."""
        if self._gate is not None:
            self._gate.count(tokens)

    def pause(self) -> None:
        """The time from now until the next turn is not a turn's (the gate's clock stops)."""
        if self._gate is not None:
            self._gate.pause()

    def prepare_chain(self, slot: Slot, spec: SpecParams) -> None:
        if spec.n_max == 0 or self.chain_factory is None:
            return  # speculation off for this task; keep the slot's chain for later tasks
        key = replace(spec, n_max=0, n_min=0)  # draft limits are passed per draft() call
        if key != slot.chain_key:
            slot.chain = self.chain_factory(spec, slot.id)
            slot.chain_key = key
            slot.spec_seen = {}

    @staticmethod
    def attach_prediction(slot: Slot, prediction: list[int]) -> None:
        """The task's prediction drafts first, before the slot's own speculators; the chain is the task's alone
        (the next task builds the slot's chain again)."""
        members = slot.chain.members if slot.chain is not None else []
        slot.chain = Chain([PredictionDrafter(prediction), *(m for m in members if m.name != PredictionDrafter.name)])
        slot.chain_key = None
        slot.spec_seen.pop(PredictionDrafter.name, None)  # a new drafter: its counts start from zero

    def drafts(self, asks: list[tuple[Slot, int, int]]) -> dict[int, list[int] | TokenTree | None]:
        """The drafts of a step's slots, by slot id, all asked at once (`draft_candidates`: the draft model drafts
        for them together). An ask is (slot, tokens decoded when the step lands, ahead: positions already taken
        past the slot's last token, the fed one, which a draft's first token stands for). A slot whose task asks
        for token trees gets every member's draft merged into one (`_draft`). None: drafting raised and the slot's
        task has failed; a slot left out has no draft."""
        wanted = []
        trees: list[int] = []  # per wanted ask: the most nodes of its token tree (0: a chain)
        drafts: dict[int, list[int] | TokenTree | None] = {}
        asks = [ask for ask in asks if ask[0].use_chain]
        # Chained drafts share DRAFT_ROWS rows a step (with hundreds of slots a floor per slot would crowd out
        # the prompt chunks); which slots get them rotates from step to step.
        budget = DRAFT_ROWS if self.chained else None
        self._turn += 1
        start = self._turn % len(asks) if asks else 0
        for slot, n_decoded, ahead in asks[start:] + asks[:start]:
            limit = self._draft_limit(slot, slot.cache, n_decoded, ahead)
            if budget is not None and limit is not None:
                limit = limit if limit - ahead <= budget else None
                budget -= limit - ahead if limit is not None else 0
            if limit is not None and slot.chain is not None:
                wanted.append((slot, (slot.chain, slot.cache, slot.last, limit, slot.task.spec.n_min + ahead)))
                trees.append(self._tree_nodes(slot, ahead))
        try:
            found = draft_candidates([ask for _, ask in wanted], [n > 0 for n in trees])
            for (slot, _), candidates, nodes in zip(wanted, found, trees, strict=True):
                drafts[slot.id] = self._draft(slot, candidates, nodes)
        except Exception:  # which slot's speculator raised: ask each alone
            for (slot, ask), nodes in zip(wanted, trees, strict=True):
                try:
                    drafts[slot.id] = self._draft(slot, draft_candidates([ask], [nodes > 0])[0], nodes)
                except Exception as exc:
                    self.failed(slot, exc)
                    drafts[slot.id] = None
        return drafts

    def _tree_nodes(self, slot: Slot, ahead: int) -> int:
        """The most nodes of the slot's token tree this step: its draft rows are the slot's share of a step's
        (`draft_cap`, as a chain's), and each candidate is as long as the slot's chain may be (its acceptance,
        `next_room`). 0: it drafts a chain (sampled tasks, fed rows, chained drafts, runners without trees, and
        slots whose recent trees did not pay for their rows, `TreeValue`)."""
        nodes = slot.task.spec.tree_nodes
        if not nodes or ahead or self.chained or not slot.greedy_only or not self.runner.token_trees:
            return 0
        if not slot.tree_value.wanted(self._row_cost):
            return 0
        # (node i goes to position len(cache) + i; draft_limit: rows a step of one sequence may have on this runner)
        return min(nodes, self._cap + 1, self.runner.draft_limit(nodes - 1) + 1, self.n_ctx - len(slot.cache))

    @staticmethod
    def _draft(slot: Slot, candidates: list[tuple[Speculator, list[int]]], nodes: int) -> list[int] | TokenTree:
        """The first candidate, or with `nodes`, the candidates' tree (a chain where they share one path)."""
        if not nodes or len(candidates) < 2:
            return candidates[0][1] if candidates else []
        tree = TokenTree.merge(slot.last, [tokens for _, tokens in candidates], nodes)
        return list(tree.tokens[1:]) if tree.is_chain else tree

    def _draft_limit(self, slot: Slot, history: list[int], n_decoded: int, ahead: int) -> int | None:
        """The most tokens a draft after the slot's last token (at position len(history)) may hold; None where
        the slot does not draft."""
        task = slot.task
        spec = task.spec
        if (not self.allowed or not slot.use_chain or slot.chain is None or slot.handle is None
                or slot.handle.cancelled):
            return None
        if self.chained and slot.draft_surplus < 0:  # its chained drafts have not paid lately
            slot.draft_surplus += SURPLUS_RECOVERY
            return None
        room = self.n_ctx - len(history) - 1  # positions left after `last`
        left = task.n_predict - n_decoded - 1 + ahead if task.n_predict >= 0 else room
        limit = min(self.runner.draft_limit(min(spec.n_max, self._cap, slot.draft_room)) + ahead, left, room)
        return limit if limit >= max(spec.n_min, 1) + ahead else None

    def failed(self, slot: Slot, exc: Exception) -> None:
        """A speculator raised (draft or prepare): that slot's task fails, the others go on."""
        log.exception("drafting failed on slot %d", slot.id)
        self._fail(slot, f"speculative drafting failed: {exc}")
