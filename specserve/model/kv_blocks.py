"""Paged KV memory, host side: which blocks of the pool hold each sequence's positions.

The pool is `n_blocks` blocks of `block_size` positions. Position p of a sequence lives in block
`tables[seq][p // block_size]` at offset `p % block_size`, so its K/V row is pool slot
`block * block_size + offset`. A sequence takes blocks from the free list as it grows and gives them back
when it is truncated: memory follows use, not slots x context. `share` gives one sequence another's
blocks (a shared prompt prefix is held once); blocks are reference-counted, and a write into a block that
another sequence also holds first gives the writer a private copy (copy on write).

Pure bookkeeping, deterministic: a remote front and each tensor-parallel rank run the same calls and agree
on every table without exchanging them.
"""

from __future__ import annotations

BLOCK_SIZE = 16  # positions a block: fine enough that a shared prefix and a short request waste little


def blocks_for(n_positions: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-n_positions // block_size)


class BlockTable:
    def __init__(self, n_seqs: int, n_blocks: int, block_size: int = BLOCK_SIZE):
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"a pool needs blocks: {n_blocks} of {block_size} positions")
        self.block_size = block_size
        self.n_blocks = n_blocks
        self.tables: list[list[int]] = [[] for _ in range(n_seqs)]
        self.refs = [0] * n_blocks
        self._free = list(range(n_blocks - 1, -1, -1))  # pop() hands out the lowest ids first

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.n_blocks - len(self._free)

    def need(self, seq: int, start: int, end: int) -> int:
        """Free blocks a write of positions [start, end) of seq would take: blocks past its table, and a private
        copy of each block it writes into that another sequence holds too. (start <= its length.)"""
        if end <= start:
            return 0
        table, b, refs = self.tables[seq], self.block_size, self.refs
        n_after = (end + b - 1) // b
        n = n_after - len(table) if n_after > len(table) else 0
        for i in range(start // b, min(n_after, len(table))):  # (a loop: on the step path, for a row or a few)
            if refs[table[i]] > 1:
                n += 1
        return n

    def positions_within(self, seq: int, start: int, blocks: int) -> int:
        """The most positions from start on that a write of seq can take with `blocks` free blocks."""
        table, b = self.tables[seq], self.block_size
        first = start // b
        n = 0  # blocks of the table from `first` on that the write can use
        while first + n < len(table) and (self.refs[table[first + n]] == 1 or blocks > 0):
            blocks -= self.refs[table[first + n]] > 1
            n += 1
        if first + n == len(table):  # past the table: a new block per free one
            n += blocks
        return max(0, (first + n) * b - start)

    def write(self, seq: int, start: int, end: int, slots: list[int] | None = None) -> list[tuple[int, int]]:
        """Give seq blocks for positions [start, end), after which it ends at `end` (a write ending before its old
        end drops what followed, as the ledger counts lengths); those positions' pool slots are appended to
        `slots`. Returns the (shared block, private copy) pairs whose contents the caller copies before writing.
        The caller checked need() against free."""
        table, b, refs = self.tables[seq], self.block_size, self.refs
        n_after = (end + b - 1) // b
        if end - start == 1 and n_after == len(table) and refs[table[-1]] == 1:  # a decode row in its own block
            if slots is not None:
                slots.append(table[-1] * b + start % b)
            return []
        if len(table) > n_after:
            self._release(table, n_after)
        copies = []
        for i in range(start // b, len(table)):
            if refs[table[i]] > 1:
                new = self._take()
                refs[table[i]] -= 1
                copies.append((table[i], new))
                table[i] = new
        while len(table) < n_after:
            table.append(self._take())
        if slots is not None:
            slots += [table[p // b] * b + p % b for p in range(start, end)]
        return copies

    def slots(self, seq: int, start: int, end: int) -> list[int]:
        """The pool slots of positions [start, end) the sequence holds."""
        table, b = self.tables[seq], self.block_size
        return [table[p // b] * b + p % b for p in range(start, end)]

    def truncate(self, seq: int, n_keep: int) -> None:
        self._release(self.tables[seq], blocks_for(n_keep, self.block_size))

    def share(self, src: int, dst: int) -> None:
        """dst holds src's blocks (its own go back first)."""
        if src == dst:
            return
        self._release(self.tables[dst], 0)
        self.tables[dst] = list(self.tables[src])
        for b in self.tables[dst]:
            self.refs[b] += 1

    def _take(self) -> int:
        block = self._free.pop()
        self.refs[block] = 1
        return block

    def _release(self, table: list[int], n_keep: int) -> None:
        while len(table) > n_keep:
            block = table.pop()
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self._free.append(block)
