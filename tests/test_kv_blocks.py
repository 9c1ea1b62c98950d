"""The paged KV pool's bookkeeping (model/kv_blocks.py, model/kv_ledger.py) against a plain model of what each
sequence holds: random writes, truncations, blocks cached by content and attached to other sequences, with every
write's values stored at the slots the table gives, must read back as the sequence's own history (an attached
block holds what its name says); blocks are neither lost nor handed out twice; need() counts what a write takes and
positions_within() is the longest write that fits."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.errors import SpecserveError
from specserve.model.batch import Batch
from specserve.model.kv_blocks import BlockTable, content_hashes
from specserve.model.kv_ledger import KVCacheFull, KVLedger

N_SEQS, N_BLOCKS, B = 3, 12, 4

ops = st.lists(st.one_of(
    st.tuples(st.just("write"), st.integers(0, N_SEQS - 1), st.integers(0, 1000), st.integers(1, 20)),
    st.tuples(st.just("truncate"), st.integers(0, N_SEQS - 1), st.integers(0, 1000)),
    st.tuples(st.just("cache"), st.integers(0, N_SEQS - 1)),
    st.tuples(st.just("attach"), st.integers(0, N_SEQS - 1), st.integers(0, N_SEQS - 1), st.integers(0, 1000)),
), max_size=60)


class Pool:
    """A pool of values per slot, written through the table as a runner writes K/V."""

    def __init__(self) -> None:
        self.slots: dict[int, int] = {}

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        for src, dst in pairs:
            for i in range(B):
                if src * B + i in self.slots:
                    self.slots[dst * B + i] = self.slots[src * B + i]


def check_invariants(t: BlockTable) -> None:
    held = [b for table in t.tables for b in table]
    assert t.used == len(set(held))  # every block in a table is out of the free list, and no other
    for b in set(held):
        assert t.refs[b] == held.count(b)
    assert sorted([*t._free, *t._cached]) == sorted(set(range(N_BLOCKS)) - set(held))
    assert all(b in t._name_of for b in t._cached) and not set(t._free) & set(t._name_of)
    assert {t._block_of[n]: n for n in t._block_of} == t._name_of  # one block a name, one name a block


@settings(max_examples=300, deadline=None)
@given(ops)
def test_tables_follow_the_sequences(steps: list[tuple]) -> None:
    t, pool = BlockTable(N_SEQS, N_BLOCKS, B), Pool()
    history: list[list[int]] = [[] for _ in range(N_SEQS)]  # what each sequence holds, position by position
    stamp = 0
    for op in steps:
        if op[0] == "write":
            _, seq, start, n = op
            start = start % (len(history[seq]) + 1)
            need = t.need(seq, start, start + n)
            fits = t.positions_within(seq, start, t.free)
            assert (need <= t.free) == (fits >= n)
            if need > t.free:
                continue
            free_before, written = t.free, []
            pool.copy(t.write(seq, start, start + n, written))
            assert written == t.slots(seq, start, start + n)
            assert free_before - t.free <= need  # (a write that shortens the sequence also gives blocks back)
            values = list(range(stamp, stamp + n))
            stamp += n
            for slot, value in zip(t.slots(seq, start, start + n), values, strict=True):
                pool.slots[slot] = value
            history[seq] = history[seq][:start] + values
        elif op[0] == "truncate":
            _, seq, n = op
            n = n % (len(history[seq]) + 1)
            t.truncate(seq, n)
            history[seq] = history[seq][:n]
        elif op[0] == "cache":  # (the stamps make every block's contents unique: names are its history)
            _, seq = op
            t.cache(seq, content_hashes(history[seq], block_size=B))
        else:  # dst takes the cached blocks of src's history, then keeps n positions of them
            _, src, dst, n = op
            t.truncate(dst, 0)
            got = t.attach(dst, content_hashes(history[src], block_size=B)) * B
            assert got <= len(history[src])
            history[dst] = history[src][:got]
            n = n % (len(history[dst]) + 1)
            t.truncate(dst, n)
            history[dst] = history[dst][:n]
        check_invariants(t)
        for seq in range(N_SEQS):
            assert len(t.tables[seq]) == -(-len(history[seq]) // B)
            assert [pool.slots[slot] for slot in t.slots(seq, 0, len(history[seq]))] == history[seq]


def test_positions_within_is_the_longest_write_that_fits() -> None:
    t = BlockTable(2, 6, 4)
    t.write(0, 0, 12)  # blocks 0, 1, 2
    t.cache(0, content_hashes(list(range(12)), block_size=4))
    t.truncate(0, 10)
    assert t.attach(1, content_hashes(list(range(12)), block_size=4)) == 3
    t.truncate(1, 10)
    for blocks in range(4):
        fits = t.positions_within(1, 10, blocks)
        assert t.need(1, 10, 10 + fits) <= blocks < t.need(1, 10, 11 + fits)
    assert t.positions_within(1, 10, 0) == 0  # the shared last block must be copied first
    assert t.positions_within(1, 12, 0) == 0 and t.positions_within(1, 12, 1) == 4
    assert t.positions_within(0, 4, 0) == 0  # block 1 is shared too


def test_ledger_refuses_a_step_the_pool_cannot_hold_and_changes_nothing() -> None:
    ledger = KVLedger(n_seqs=2, n_ctx=64, vocab_size=100, kv_size=32, block_size=16)  # two blocks in all
    batch = Batch()
    batch.add_sequence(list(range(20)), 0, 0, "last")
    admitted = ledger.admit(batch, None)
    assert admitted.slots == ledger.blocks.slots(0, 0, 20) and ledger.blocks.free == 0
    more = Batch()
    more.add_sequence([1, 2], 0, 1, "last")
    with pytest.raises(KVCacheFull, match="KV cache is full"):
        ledger.admit(more, None)
    assert ledger.seq_len == [20, 0] and ledger.blocks.free == 0
    ledger.truncate(0, 16)  # gives the second block back
    assert ledger.blocks.free == 1
    ledger.admit(more, None)
    with pytest.raises(SpecserveError, match="context size"):  # a sequence's own limit still holds
        big = Batch()
        big.add_sequence(list(range(65)), 0, 1, "last")
        ledger.admit(big, None)


def test_a_cached_prefix_is_held_once_and_copied_on_write() -> None:
    ledger = KVLedger(n_seqs=2, n_ctx=64, vocab_size=100, kv_size=64, block_size=16)
    tokens = list(range(48))
    batch = Batch()
    batch.add_sequence(tokens, 0, 0, "last")
    ledger.admit(batch, None)
    ledger.cache(0, content_hashes(tokens + [1] * 16))  # (names past what it holds are ignored)
    assert ledger.blocks.n_cached == 3
    assert ledger.attach(1, content_hashes(tokens)) == 48
    ledger.truncate(1, 36)
    assert ledger.blocks.free == 1  # three blocks, held by both sequences
    step = Batch()
    step.add_sequence([7], 36, 1, "last")  # into the shared third block: sequence 1 gets its own copy of it
    admitted = ledger.admit(step, None)
    assert admitted.copies == [(ledger.blocks.tables[0][2], ledger.blocks.tables[1][2])]
    assert ledger.blocks.tables[0][:2] == ledger.blocks.tables[1][:2] and ledger.blocks.free == 0


def test_cached_blocks_outlive_their_holders_until_the_pool_needs_them() -> None:
    """A named block no sequence holds stays attachable and counts as free; a write short of plain free blocks
    takes the one given up longest ago (and its name goes); a write into a named block copies it first."""
    t = BlockTable(2, 4, 4)
    a, b = list(range(100, 108)), list(range(200, 208))
    t.write(0, 0, 8)
    t.cache(0, content_hashes(a, block_size=4))
    t.truncate(0, 0)  # a's two blocks: cached, no holder
    t.write(1, 0, 8)
    t.cache(1, content_hashes(b, block_size=4))
    t.truncate(1, 0)
    assert t.free == 4 and t.n_cached == 4
    assert t.cached_run(content_hashes(a, block_size=4)) == 2
    # no plain free block: a write takes the block given up first, a's last (a sequence gives its blocks up from the
    # end, so a prefix loses its tail first)
    t.write(0, 0, 4)
    assert t.cached_run(content_hashes(a, block_size=4)) == 1 and t.cached_run(content_hashes(b, block_size=4)) == 2
    assert t.attach(1, content_hashes(b, block_size=4)) == 2 and t.free == 1
    t.truncate(1, 6)
    second = t.tables[1][1]
    assert t.need(1, 6, 7) == 1
    copies = t.write(1, 6, 7)  # into b's second block, held by sequence 1 alone: a copy is written, b keeps it
    # the copy took a's last cached block; b's second, held by no one now, is cached among the free ones
    assert copies == [(second, t.tables[1][1])] and t.free == 1 and t.cached_run(content_hashes(a, block_size=4)) == 0
    assert t.cached_run(content_hashes(b, block_size=4)) == 2 and t.n_cached == 2


def test_batch_runs_known_as_built_match_the_computed_ones():
    """add_sequence/add_row keep the runs as the batch grows; they must equal those read from its rows."""
    from specserve.model.batch import Batch

    def computed(b: Batch) -> list[tuple[int, int, int, int]]:
        return Batch(list(b.tokens), list(b.positions), list(b.seq_ids), list(b.want_logits)).runs()

    b = Batch()
    b.add_sequence([1, 2, 3], 5, 0, "last")
    b.add_row(7, 9, 1, True)
    b.add_sequence([4, 5], 8, 0 + 2, "all")
    b.add_sequence([6], 10, 2, "none")  # continues seq 2's run: one run
    assert b.gapless and b.runs() == computed(b) == [(0, 0, 3, 8), (1, 3, 4, 10), (2, 4, 7, 11)]
    b.add_sequence([8], 20, 2, "none")  # a gap in seq 2: no longer known, computed from the rows
    assert not b.gapless and b.runs() == computed(b)
    c = Batch()
    c.add(1, 0, 0)
    assert not c.gapless and c.runs() == [(0, 0, 1, 1)]
    assert not Batch([1], [0], [0], [True]).gapless


def test_ledger_still_refuses_a_gap_in_a_built_batch():
    import pytest

    from specserve.errors import SpecserveError
    from specserve.model.batch import Batch
    from specserve.model.kv_ledger import KVLedger

    ledger = KVLedger(2, 64, 100)
    ok = Batch()
    ok.add_sequence([1, 2], 0, 0)
    ledger.admit(ok, None)
    gap = Batch()
    gap.add_sequence([3], 1, 0)
    gap.add_sequence([4], 3, 0)  # position 2 skipped
    with pytest.raises(SpecserveError, match="without gaps"):
        ledger.admit(gap, None)
    late = Batch()
    late.add_row(5, 4, 1, True)  # sequence 1 holds nothing: position 4 leaves a gap
    with pytest.raises(SpecserveError, match="without gaps"):
        ledger.admit(late, None)
