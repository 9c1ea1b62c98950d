"""What a runner knows of its KV cache without looking at it: each sequence's length, and whether a batch
may be evaluated against it. Shared by the local runner and the remote one (which keeps a mirror of the
host's)."""

from __future__ import annotations

from collections.abc import Sequence

from specserve.errors import SpecserveError
from specserve.model.batch import Batch

MAX_LOGIT_ROWS = 16384  # rows one step may want logits of (the argmax ring's width on a local runner)


class KVLedger:
    def __init__(self, n_seqs: int, n_ctx: int, vocab_size: int):
        self.n_seqs = n_seqs
        self.n_ctx = n_ctx
        self.vocab_size = vocab_size
        self.seq_len = [0] * n_seqs
        self.last_rows = 0  # rows of the last launched step (what fed indices may name)

    def admit(self, batch: Batch, fed: Sequence[int] | None) -> list[tuple[int, int, int, int]]:
        """Check a batch about to be launched and account it: its runs; SpecserveError (nothing changed) if
        it does not fit. Positions of a sequence must continue its cache without gaps."""
        runs = batch.runs()
        self.check(batch, runs, fed)
        self.last_rows = len(batch)
        for seq, _start, _end, kv_len in runs:  # writing at position p makes p the sequence's end
            self.seq_len[seq] = kv_len
        return runs

    def check(self, batch: Batch, runs: list[tuple[int, int, int, int]], fed: Sequence[int] | None) -> None:
        if len(batch) == 0:
            raise SpecserveError("empty batch")
        if len(batch.logit_rows()) > MAX_LOGIT_ROWS:
            raise SpecserveError(f"a step may want the logits of at most {MAX_LOGIT_ROWS} rows")
        if fed is not None and (len(fed) != len(batch) or max(fed, default=-1) >= self.last_rows):
            raise SpecserveError("fed rows must name rows of the step launched before")
        seen: set[int] = set()
        for seq, start, end, kv_len in runs:
            if not 0 <= seq < self.n_seqs:
                raise SpecserveError(f"sequence id {seq} out of range (0..{self.n_seqs - 1})")
            if seq in seen:
                raise SpecserveError(f"rows of sequence {seq} are not consecutive in the batch")
            seen.add(seq)
            pos = batch.positions[start:end]
            if pos[0] > self.seq_len[seq] or pos != list(range(pos[0], pos[0] + len(pos))):
                raise SpecserveError(f"positions of sequence {seq} must continue its cache without gaps")
            if kv_len > self.n_ctx:
                raise SpecserveError(f"sequence {seq} would exceed the context size ({self.n_ctx})")
        if not 0 <= min(batch.tokens) <= max(batch.tokens) < self.vocab_size:  # (C loops: on the step path)
            bad = next(t for t in batch.tokens if not 0 <= t < self.vocab_size)
            raise SpecserveError(f"token id {bad} out of range (vocabulary size {self.vocab_size})")

    def truncate(self, seq: int, n_keep: int) -> None:
        """Keep the first n_keep positions of a sequence (drops rejected draft tokens)."""
        if not 0 <= seq < self.n_seqs:
            raise SpecserveError(f"sequence id {seq} out of range (0..{self.n_seqs - 1})")
        if not 0 <= n_keep <= self.seq_len[seq]:
            raise SpecserveError(f"cannot truncate sequence {seq} of length {self.seq_len[seq]} to {n_keep}")
        self.seq_len[seq] = n_keep

    def restore(self, seq: int, n: int) -> None:
        """The sequence now holds n positions written from elsewhere (a saved slot)."""
        if not 0 <= seq < self.n_seqs:
            raise SpecserveError(f"sequence id {seq} out of range (0..{self.n_seqs - 1})")
        if not 0 <= n <= self.n_ctx:
            raise SpecserveError(f"{n} positions do not fit a sequence of {self.n_ctx}")
        self.seq_len[seq] = n
        self.last_rows = 0  # nothing may be fed from a step before this

    def copy(self, src: int, dst: int) -> None:
        if not (0 <= src < self.n_seqs and 0 <= dst < self.n_seqs):
            raise SpecserveError(f"cannot copy sequence {src} to {dst}")
        self.seq_len[dst] = self.seq_len[src]
