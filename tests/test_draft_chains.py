"""draft_chains: every ask's chain tries its members in order, and a member type that proposes for several
sequences at once (propose_together, the draft model's) gets all the asks that reach it in one call."""

from __future__ import annotations

from specserve.speculative.base import Chain, ProposeAsk, Speculator, draft_chains


class Fixed(Speculator):
    """Proposes `tokens` (none: nothing to draft)."""

    name = "fixed"

    def __init__(self, tokens: list[int]):
        super().__init__()
        self.tokens = tokens

    def _propose(self, history: list[int], last_sampled: int, n_max: int) -> list[int]:
        return self.tokens


calls: list[list[tuple[int, int]]] = []  # each propose_together call's (history length, last sampled) asks


class Together(Speculator):
    """Proposes [last + 1, last + 2, ...] up to n_max, for every ask at once; nothing for last 0."""

    name = "together"

    def _propose(self, history: list[int], last_sampled: int, n_max: int) -> list[int]:
        raise AssertionError("asked alone")

    @staticmethod
    def _together(asks: list[ProposeAsk]) -> list[list[int]]:
        calls.append([(len(h), last) for _, h, last, _ in asks])
        return [[last + i for i in range(1, n_max + 1)] if last else [] for _, _, last, n_max in asks]


Together.propose_together = staticmethod(Together._together)  # type: ignore[assignment]


def test_members_in_order_and_one_call_for_all_that_reach_the_shared_member() -> None:
    calls.clear()
    free_hit = Chain([Fixed([7, 8]), Together()])  # the draft-free member drafts: the shared one is not asked
    shared_a, shared_b = Chain([Fixed([]), Together()]), Chain([Together()])
    falls_through = Chain([Together(), Fixed([9])])  # the shared member has nothing: the next member drafts
    asks = [(free_hit, [1, 2], 3, 4, 0), (shared_a, [1], 10, 3, 0), (shared_b, [1, 2, 3], 20, 2, 0),
            (falls_through, [1], 0, 4, 0)]
    assert draft_chains(asks) == [[7, 8], [11, 12, 13], [21, 22], [9]]
    assert calls == [[(1, 10), (3, 20), (1, 0)]]
    # accept() goes to the member whose draft it was, with its statistics
    for chain in (free_hit, shared_a, falls_through):
        chain.accept(1)
    assert free_hit.members[0].stats.acc_tokens == 1 and free_hit.members[1].stats.calls == 0
    assert shared_a.members[1].stats.acc_tokens == 1 and shared_a.members[1].stats.gen_tokens == 3
    assert falls_through.members[1].stats.acc_tokens == 1 and falls_through.members[0].stats.acc_tokens == 0


def test_n_min_and_n_max_apply_to_shared_proposals() -> None:
    calls.clear()
    short, long = Chain([Together()]), Chain([Together()])
    assert draft_chains([(short, [1], 5, 2, 3), (long, [1], 5, 6, 3)]) == [[], [6, 7, 8, 9, 10, 11]]
    assert short.members[0].stats.calls == 1 and short.members[0].stats.gen_drafts == 0
