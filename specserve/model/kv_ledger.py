"""What a runner knows of its KV cache without looking at it: each sequence's length, which pool blocks hold it
(kv_blocks.py), and whether a batch may be evaluated against it. Shared by the local runner and the remote one
(which keeps a mirror of the host's: the same calls give the same tables)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specserve.errors import SpecserveError
from specserve.model.batch import Batch
from specserve.model.kv_blocks import BLOCK_SIZE, BlockTable, blocks_for

MAX_LOGIT_ROWS = 16384  # rows one step may want logits of (the argmax ring's width on a local runner)


class KVCacheFull(SpecserveError):
    """The pool has too few free blocks for a write (the scheduler plans within kv_free_blocks first)."""


@dataclass
class Admitted:
    """A batch accounted for: its runs (Batch.runs()), each row's pool slot, and the (shared, private) block
    pairs to copy before the batch writes (copy on write)."""

    runs: list[tuple[int, int, int, int]]
    slots: list[int]
    copies: list[tuple[int, int]]


class LedgerOnlyKV:
    """The Runner's KV calls for runners whose cache is only bookkeeping (test and benchmark stand-ins): each is the
    ledger's own."""

    ledger: KVLedger
    token_trees = False

    def kv_truncate(self, seq: int, n_keep: int) -> None:
        self.ledger.truncate(seq, n_keep)

    def kv_compact(self, seq: int, start: int, path: Sequence[int]) -> None:
        self.ledger.truncate(seq, start + len(path))

    def kv_cache(self, seq: int, names: Sequence[int]) -> None:
        self.ledger.cache(seq, names)

    def kv_attach(self, seq: int, names: Sequence[int]) -> int:
        return self.ledger.attach(seq, names)


class KVLedger:
    def __init__(self, n_seqs: int, n_ctx: int, vocab_size: int, kv_size: int | None = None,
                 block_size: int = BLOCK_SIZE):
        """n_ctx: positions one sequence may reach; kv_size: positions of the pool all sequences share (default
        n_seqs * n_ctx: every sequence can be full at once)."""
        self.n_seqs = n_seqs
        self.n_ctx = n_ctx
        self.vocab_size = vocab_size
        self.blocks = BlockTable(n_seqs, blocks_for(kv_size or n_seqs * n_ctx, block_size), block_size)
        self.seq_len = [0] * n_seqs
        self.last_rows = 0  # rows of the last launched step (what fed indices may name)

    @property
    def kv_size(self) -> int:
        return self.blocks.n_blocks * self.blocks.block_size

    def admit(self, batch: Batch, fed: Sequence[int] | None) -> Admitted:
        """Check a batch about to be launched and account it; SpecserveError (nothing changed) if it does not
        fit. Positions of a sequence must continue its cache without gaps."""
        runs = batch.runs()
        self.check(batch, runs, fed)
        self.last_rows = len(batch)
        copies: list[tuple[int, int]] = []
        slots: list[int] = []
        blocks, positions = self.blocks, batch.positions
        for seq, start, _end, kv_len in runs:  # writing at position p makes p the sequence's end
            copies += blocks.write(seq, positions[start], kv_len, slots)
            self.seq_len[seq] = kv_len
        return Admitted(runs, slots, copies)

    def check(self, batch: Batch, runs: list[tuple[int, int, int, int]], fed: Sequence[int] | None) -> None:
        if len(batch) == 0:
            raise SpecserveError("empty batch")
        if batch.want_logits.count(True) > MAX_LOGIT_ROWS:
            raise SpecserveError(f"a step may want the logits of at most {MAX_LOGIT_ROWS} rows")
        if fed is not None and (len(fed) != len(batch) or max(fed, default=-1) >= self.last_rows):
            raise SpecserveError("fed rows must name rows of the step launched before")
        seen: set[int] = set()
        gapless = batch.gapless  # (built run by run: no per-row check)
        # A run takes at most a block a 16 positions, one more where it starts mid-block, one copied where it
        # starts in a shared block: with that many free, the exact count is not needed (the step path).
        exact = self.blocks.free < len(batch) // self.blocks.block_size + 3 * len(runs)
        need = 0
        for seq, start, end, kv_len in runs:
            if not 0 <= seq < self.n_seqs:
                raise SpecserveError(f"sequence id {seq} out of range (0..{self.n_seqs - 1})")
            if seq in seen:
                raise SpecserveError(f"rows of sequence {seq} are not consecutive in the batch")
            seen.add(seq)
            first = batch.positions[start]
            if first > self.seq_len[seq] or not gapless and (
                    batch.positions[start:end] != list(range(first, first + end - start))):
                raise SpecserveError(f"positions of sequence {seq} must continue its cache without gaps")
            if kv_len > self.n_ctx:
                raise SpecserveError(f"sequence {seq} would exceed the context size ({self.n_ctx})")
            if exact:
                need += self.blocks.need(seq, first, kv_len)
        if need > self.blocks.free:
            raise KVCacheFull(f"the KV cache is full: the step needs {need} free blocks, {self.blocks.free} are left")
        if not 0 <= min(batch.tokens) <= max(batch.tokens) < self.vocab_size:  # (C loops: on the step path)
            bad = next(t for t in batch.tokens if not 0 <= t < self.vocab_size)
            raise SpecserveError(f"token id {bad} out of range (vocabulary size {self.vocab_size})")

    def truncate(self, seq: int, n_keep: int) -> None:
        """Keep the first n_keep positions of a sequence (drops rejected draft tokens)."""
        self._check_seq(seq)
        if not 0 <= n_keep <= self.seq_len[seq]:
            raise SpecserveError(f"cannot truncate sequence {seq} of length {self.seq_len[seq]} to {n_keep}")
        self.seq_len[seq] = n_keep
        self.blocks.truncate(seq, n_keep)

    def restore(self, seq: int, n: int) -> list[int]:
        """The sequence now holds n positions written from elsewhere (a saved slot); their pool slots."""
        self._check_seq(seq)
        if not 0 <= n <= self.n_ctx:
            raise SpecserveError(f"{n} positions do not fit a sequence of {self.n_ctx}")
        self.truncate(seq, 0)
        if self.blocks.need(seq, 0, n) > self.blocks.free:
            raise KVCacheFull(f"the KV cache has no room for {n} positions now")
        self.blocks.write(seq, 0, n)
        self.seq_len[seq] = n  # (the last step's rows may still be fed from: writing K/V launches no step)
        return self.blocks.slots(seq, 0, n)

    def cache(self, seq: int, names: Sequence[int]) -> None:
        """Name the sequence's full blocks by `names` (kv_blocks.content_hashes of the tokens it holds) so that
        `attach` finds them; names past what it holds are ignored."""
        self._check_seq(seq)
        self.blocks.cache(seq, names[:self.seq_len[seq] // self.blocks.block_size])

    def attach(self, seq: int, names: Sequence[int]) -> int:
        """The sequence (its own positions given up first) takes the cached blocks of the longest run of `names`;
        the positions it now holds."""
        self.truncate(seq, 0)
        self.seq_len[seq] = self.blocks.attach(seq, names) * self.blocks.block_size
        return self.seq_len[seq]

    def _check_seq(self, seq: int) -> None:
        if not 0 <= seq < self.n_seqs:
            raise SpecserveError(f"sequence id {seq} out of range (0..{self.n_seqs - 1})")
