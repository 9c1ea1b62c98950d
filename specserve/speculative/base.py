"""The Speculator interface, its parameters and its statistics."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar

from specserve.errors import SpecserveError
from specserve.model.batch import common_prefix
from specserve.model.token_tree import MAX_TREE_NODES
from specserve.speculative.ngram_index import HistoryIndex

SPEC_TYPES = ("none", "draft", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-cache", "ngram-suffix")
# Types selectable with --spec-type / speculative.type ("draft" follows from a draft model).
SELECTABLE_TYPES = ("none", "ngram-cache", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-suffix")


@dataclass
class SpecParams:
    """Speculative-decoding options; names follow llama.cpp's common_params_speculative."""

    type: str = "none"
    n_max: int = 16  # --draft-max
    n_min: int = 0  # --draft-min
    p_min: float = 0.75  # --draft-p-min
    ngram_size_n: int = 12
    ngram_size_m: int = 48
    ngram_check_rate: int = 1
    ngram_min_hits: int = 1
    lookup_cache_static: str | None = None
    lookup_cache_dynamic: str | None = None
    # Whose earlier requests shared-suffix drafts from (shared_suffix.py): the server's name for the request's
    # API key and the client's `speculative.scope`; "" with the shared store off.
    scope: str = ""
    # The most nodes of a token tree (model/token_tree.py) merged from every member's draft, verified in one step
    # (greedy tasks on runners that take trees); 0: the first member's draft alone, as llama.cpp's chains.
    tree_nodes: int = 0

    def validate(self) -> SpecParams:
        """Raise SpecserveError naming the first out-of-range option; return self."""
        if self.type not in SELECTABLE_TYPES:
            raise SpecserveError(
                f"unknown speculative type '{self.type}' (expected one of: {', '.join(SELECTABLE_TYPES)})"
            )
        for name, lo, hi in (
            ("ngram_size_n", 1, 1024),
            ("ngram_size_m", 1, 1024),
            ("ngram_check_rate", 1, None),
            ("ngram_min_hits", 1, None),
            ("n_max", 0, None),
            ("n_min", 0, None),
            ("tree_nodes", 0, MAX_TREE_NODES),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise SpecserveError(f"speculative {name} must be an integer, got {value!r}")
            if value < lo or (hi is not None and value > hi):
                bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
                raise SpecserveError(f"speculative {name} = {value} is out of range {bound}")
        if self.n_min > self.n_max:
            raise SpecserveError(f"speculative n_min ({self.n_min}) must not exceed n_max ({self.n_max})")
        if isinstance(self.p_min, bool) or not isinstance(self.p_min, int | float) or not 0.0 <= self.p_min <= 1.0:
            raise SpecserveError(f"speculative p_min = {self.p_min!r} is out of range [0, 1]")
        return self

    def with_overrides(self, **overrides: Any) -> SpecParams:
        """A validated copy with some fields replaced (per-request `speculative.*`)."""
        known = {f.name for f in fields(self)}
        unknown = set(overrides) - known
        if unknown:
            raise SpecserveError(f"unknown speculative option(s): {', '.join(sorted(unknown))}")
        return replace(self, **overrides).validate()


@dataclass
class SpecStats:
    """Counters printed as llama.cpp's `statistics <type>: ...` line."""

    calls: int = 0  # draft() calls
    gen_drafts: int = 0  # non-empty drafts
    acc_drafts: int = 0  # drafts with at least one accepted token
    gen_tokens: int = 0  # drafted tokens
    acc_tokens: int = 0  # accepted tokens

    def line(self, name: str) -> str:
        return (
            f"statistics {name}: #calls = {self.calls}, #gen drafts = {self.gen_drafts}, "
            f"#acc drafts = {self.acc_drafts}, #gen tokens = {self.gen_tokens}, #acc tokens = {self.acc_tokens}"
        )


def acceptance_line(accepted: int, generated: int) -> str:
    rate = accepted / generated if generated else 0.0
    return f"draft acceptance rate = {rate:.5f} ({accepted:5d} accepted / {generated:5d} generated)"


class Speculator(ABC):
    """Proposes draft tokens for one sequence; told afterwards how many were accepted.

    Lifecycle per generation: begin(prompt) once, then repeatedly draft(...) / accept(n),
    then end(). `history` passed to draft() is every token already in the target's KV cache
    (prompt + accepted generated tokens); `last_sampled` is the newest token, not yet
    evaluated by the target. Subclasses implement `_propose` (and optionally `_accepted`);
    the public methods keep the statistics.
    """

    name: str = "base"  # statistics label, e.g. "ngram_simple"
    _index: HistoryIndex | None = None  # an index over the history, kept up to date by prepare()
    # A type that proposes for several sequences at once (the draft model: shared forwards) sets this to a
    # function from [(speculator, history, last_sampled, n_max)] to their proposals; `draft_chains` uses it.
    propose_together: ClassVar[ProposeTogether | None] = None

    def __init__(self) -> None:
        self.stats = SpecStats()
        self._draft_pending = False  # a non-empty draft awaits its accept()

    def begin(self, prompt: list[int]) -> None:  # noqa: B027 - optional hook
        """Called once after the prompt is evaluated."""

    def prepare(self, history: list[int]) -> None:
        """Called while the device evaluates a step: bookkeeping for `history` that the next draft()
        would otherwise do on the critical path (here: indexing it, for types that keep a history
        index in `_index`). draft() must not depend on it."""
        if self._index is not None:
            self._index.update(history)

    def draft(self, history: list[int], last_sampled: int, n_max: int, n_min: int = 0) -> list[int]:
        """Up to n_max tokens proposed to follow last_sampled; [] if fewer than n_min."""
        return self.take(self._propose(history, last_sampled, n_max) if n_max > 0 else [], n_max, n_min)

    def take(self, proposal: list[int], n_max: int, n_min: int = 0) -> list[int]:
        """draft()'s result for a proposal already made (`propose_together`), with its statistics."""
        self.stats.calls += 1
        self._draft_pending = False
        tokens = proposal[:n_max] if n_max > 0 else []
        if len(tokens) < max(n_min, 1):
            return []
        self._draft_pending = True
        self.stats.gen_drafts += 1
        self.stats.gen_tokens += len(tokens)
        return tokens

    def accept(self, n_accepted: int) -> None:
        """How many tokens of the last non-empty draft the target accepted.

        Ignored when the last draft() returned nothing: feedback about a draft that was never
        verified (e.g. dropped for being shorter than n_min) must not reach `_accepted`.
        """
        if not self._draft_pending:
            return
        self._draft_pending = False
        if n_accepted > 0:
            self.stats.acc_drafts += 1
            self.stats.acc_tokens += n_accepted
        self._accepted(n_accepted)

    def end(self, history: list[int]) -> None:  # noqa: B027 - optional hook
        """The generation is over, `history` what it holds (its prompt and what it kept): e.g. save a dynamic
        cache. Turns that skip `prepare` leave a speculator's view of the history behind; this one is whole."""

    def alternatives(self, history: list[int], last_sampled: int, n_max: int, first: list[int]) -> list[list[int]]:
        """Other continuations than `first` (this speculator's draft just made), each starting with another token,
        for a token tree's other branches; none by default. Their tokens count as generated."""
        return []

    @abstractmethod
    def _propose(self, history: list[int], last_sampled: int, n_max: int) -> list[int]:
        """The type's drafting rule; may return more than n_max (the caller trims)."""

    def _accepted(self, n_accepted: int) -> None:  # noqa: B027 - optional hook
        """Type-specific feedback (e.g. ngram-map's accepted-count memory)."""


class Chain:
    """Tries its members in order; the first non-empty draft wins (draft-free types first).

    Each member keeps its own statistics; `accept` goes to the member whose draft it was.
    """

    def __init__(self, members: list[Speculator]):
        self.members = members
        self._last: Speculator | None = None
        self.tree: list[tuple[Speculator, list[int]]] = []  # the candidates of the last token tree drafted

    def begin(self, prompt: list[int]) -> None:
        for m in self.members:
            m.begin(prompt)

    def prepare(self, history: list[int]) -> None:
        for m in self.members:
            m.prepare(history)

    def draft(self, history: list[int], last_sampled: int, n_max: int, n_min: int = 0) -> list[int]:
        return draft_chains([(self, history, last_sampled, n_max, n_min)])[0]

    def accept(self, n_accepted: int) -> None:
        if self._last is not None:
            self._last.accept(n_accepted)

    def accept_path(self, accepted: list[int]) -> None:
        """A token tree's verdict: the draft tokens accepted; each member learns how many of its own tokens that is
        (the most of its candidates')."""
        best: dict[Speculator, int] = {}
        for member, tokens in self.tree:
            best[member] = max(best.get(member, 0), common_prefix(tokens, accepted))
        for member, n in best.items():
            member.accept(n)
        self.tree = []

    def end(self, history: list[int]) -> None:
        for m in self.members:
            m.end(history)

    def totals(self) -> SpecStats:
        total = SpecStats()
        for m in self.members:
            for f in fields(SpecStats):
                setattr(total, f.name, getattr(total, f.name) + getattr(m.stats, f.name))
        return total

    def stat_lines(self) -> list[str]:
        t = self.totals()
        return [acceptance_line(t.acc_tokens, t.gen_tokens)] + [m.stats.line(m.name) for m in self.members]


ProposeAsk = tuple[Speculator, list[int], int, int]  # (speculator, history, last sampled, n_max)
ProposeTogether = Callable[[list[ProposeAsk]], list[list[int]]]  # see Speculator.propose_together
DraftAsk = tuple[Chain, list[int], int, int, int]  # (chain, history, last sampled, n_max, n_min)


def draft_chains(asks: list[DraftAsk]) -> list[list[int]]:
    """Each ask's draft, as its chain's members in order give it: the first non-empty one wins."""
    return [candidates[0][1] if candidates else [] for candidates in draft_candidates(asks, [False] * len(asks))]


def draft_candidates(asks: list[DraftAsk], every: list[bool]) -> list[list[tuple[Speculator, list[int]]]]:
    """Each ask's non-empty drafts and the members that gave them, in the chain's order: every member's where
    `every[i]` (the candidates of a token tree; the chain's `tree` records them for `accept_path`), else only the
    first that drafts (the chain's draft). Members of a type with `propose_together` propose for all the asks that
    reach them in one call (the draft model drafts for every slot of a step in shared forwards, one per draft
    token)."""
    found: list[list[tuple[Speculator, list[int]]]] = [[] for _ in asks]
    position = [0] * len(asks)  # the member each ask tries next
    pending = list(range(len(asks)))

    def keep(i: int, member: Speculator, tokens: list[int]) -> None:
        if tokens:
            chain, history, last, n_max, _ = asks[i]
            chain._last = chain._last or member  # (the first member that drafted)
            found[i].append((member, tokens))
            if every[i]:
                found[i] += [(member, alt) for alt in member.alternatives(history, last, n_max, tokens)]
            else:
                position[i] = len(chain.members)

    while pending:
        together: dict[ProposeTogether, list[int]] = {}
        for i in pending:
            chain, history, last, n_max, n_min = asks[i]
            if position[i] == 0:
                chain._last = None
            while position[i] < len(chain.members):
                m = chain.members[position[i]]
                propose_together = type(m).propose_together
                if propose_together is not None:
                    together.setdefault(propose_together, []).append(i)
                    break
                position[i] += 1
                keep(i, m, m.draft(history, last, n_max, n_min))
        pending = []
        for propose, ids in together.items():
            members = [asks[i][0].members[position[i]] for i in ids]
            proposals = propose([(m, asks[i][1], asks[i][2], asks[i][3]) for m, i in zip(members, ids, strict=True)])
            for m, i, proposal in zip(members, ids, proposals, strict=True):
                n_max, n_min = asks[i][3], asks[i][4]
                position[i] += 1
                keep(i, m, m.take(proposal, n_max, n_min))
                if position[i] < len(asks[i][0].members):
                    pending.append(i)  # the members after it, in order
    for (chain, *_), candidates, all_of_them in zip(asks, found, every, strict=True):
        chain.tree = candidates if all_of_them else []
    return found
