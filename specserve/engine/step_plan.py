"""One step as the scheduler plans it: a Batch over the active slots, and what each slot's rows mean."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.engine.runner import Step
from specserve.engine.slots import Slot
from specserve.model.batch import Batch
from specserve.model.token_tree import TokenTree


@dataclass(slots=True)
class Entry:
    """One slot's rows in a step."""

    slot: Slot
    task_id: int
    first_row: int  # its first row in the batch
    n_rows: int
    logit_row: int  # where its rows' logits start among the step's logit rows
    prompt: bool  # a prompt chunk (else a decode or verify step)
    final: bool = False  # prompt: the last chunk (its one logit row gives the first token)
    replay: bool = False  # prompt: tokens a preempted slot held, read again (no logits)
    draft: list[int] = field(default_factory=list)  # decode: the tokens of rows 1.., checked by rows 0..
    guess: int | None = None  # decode, fed with a draft: what the speculator took row 0's token to be
    position: int = 0  # decode: the position of row 0, where the slot's cache ends when the entry is right
    tree: TokenTree | None = None  # decode: rows that are a token tree's nodes (draft: its tokens after the root)

    def current(self) -> bool:
        """Whether its slot still runs the same task from where the entry was planned: a decode entry fed from a
        drafted step assumed every draft token accepted, and is stale once that step kept fewer."""
        slot = self.slot
        return slot.runs(self.task_id) and (self.prompt or len(slot.cache) == self.position)

    @property
    def n_logits(self) -> int:
        return int(self.final) if self.prompt else self.n_rows

    @property
    def fed_position(self) -> int:
        """Where a row fed from this in-flight entry goes (after a draft: where it goes if all of it is accepted)."""
        return len(self.slot.task.prompt) if self.prompt else self.position + self.n_rows

    def ends(self, n_ctx: int) -> bool:
        """Whether this in-flight entry's step gives its slot's last token for sure: its n_predict reached (at least
        one token comes of every step), or no position left for a next row."""
        return 0 <= self.slot.task.n_predict <= self.slot.n_decoded + 1 or self.fed_position >= n_ctx

    @property
    def last_logit_row(self) -> int:
        """The batch row a following step may take its fed token from."""
        return self.first_row + self.n_rows - 1


@dataclass
class Plan:
    batch: Batch = field(default_factory=Batch)
    fed: list[int] = field(default_factory=list)  # per row: the previous step's row whose argmax is its token
    entries: list[Entry] = field(default_factory=list)
    n_logits: int = 0

    def _add(self, entry: Entry, fed_row: int) -> None:
        self.fed.append(fed_row)
        if entry.n_rows > 1:
            self.fed.extend([-1] * (entry.n_rows - 1))
        self.entries.append(entry)
        self.n_logits += entry.n_logits

    def add_decode(self, slot: Slot, position: int, first: int, draft: list[int], fed_row: int = -1,
                   guess: int | None = None) -> None:
        """Rows [first, *draft] at position..; fed_row >= 0: first is the previous step's argmax at that row."""
        assert slot.handle is not None
        entry = Entry(slot, slot.handle.task.id, len(self.batch), 1 + len(draft), self.n_logits, False, False,
                      False, draft, guess, position)
        if draft:
            self.batch.add_sequence([first, *draft], position, slot.id, "all")
        else:
            self.batch.add_row(first, position, slot.id, True)
        self._add(entry, fed_row)

    def add_tree(self, slot: Slot, position: int, tree: TokenTree) -> None:
        """A token tree's nodes at position.. (the root is slot.last, from the host; never fed: such a step is
        settled before the next is planned)."""
        assert slot.handle is not None
        entry = Entry(slot, slot.handle.task.id, len(self.batch), len(tree), self.n_logits, False, False, False,
                      list(tree.tokens[1:]), None, position, tree)
        self.batch.add_tree(tree, position, slot.id)
        self._add(entry, -1)

    def add_prompt(self, slot: Slot, chunk: list[int], start: int, final: bool, replay: bool = False) -> None:
        entry = Entry(slot, slot.task.id, len(self.batch), len(chunk), self.n_logits, prompt=True, final=final,
                      replay=replay)
        self.batch.add_sequence(chunk, start, slot.id, "last" if final else "none")
        self._add(entry, -1)

    def fed_rows(self) -> list[int] | None:
        return self.fed if any(f >= 0 for f in self.fed) else None


@dataclass
class InFlight:
    """A launched step, not yet settled."""

    step: Step
    entries: list[Entry]
    trace: int = -1  # its index in the step trace (step_trace.py), if one is kept

    def live(self) -> list[Entry]:
        """Entries whose slot still runs the same task from where they were planned (Entry.current)."""
        return [e for e in self.entries if e.current()]
