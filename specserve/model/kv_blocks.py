"""Paged KV memory, host side: which blocks of the pool hold each sequence's positions.

The pool is `n_blocks` blocks of `block_size` positions. Position p of a sequence lives in block
`tables[seq][p // block_size]` at offset `p % block_size`, so its K/V row is pool slot
`block * block_size + offset`. A sequence takes blocks from the free list as it grows and gives them back
when it is truncated: memory follows use, not slots x context. Blocks are reference-counted, and a write into a
block that another sequence also holds first gives the writer a private copy (copy on write).

Full blocks are also cached by content: `cache` names a sequence's full blocks by a hash of everything up to
their end (`content_hashes`: the tokens and what else decides their K/V), and `attach` gives a sequence that holds
nothing the blocks of the longest run of such names the pool still has, so a shared system prompt, a
conversation's earlier turns or another tenant's prefix is read once. A named block that no sequence holds any
more keeps its contents among the free blocks (`free` counts it) until a write needs a block and the plain free
list is empty: then the least recently given up goes first (LRU). A write into a named block copies it first, as
into a shared one, so the name keeps its contents.

Pure bookkeeping, deterministic: a remote front and each tensor-parallel rank run the same calls and agree
on every table without exchanging them.
"""

from __future__ import annotations

from collections.abc import Sequence

BLOCK_SIZE = 16  # positions a block: fine enough that a shared prefix and a short request waste little


def blocks_for(n_positions: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-n_positions // block_size)


def content_hashes(tokens: Sequence[int], salt: object = (), block_size: int = BLOCK_SIZE,
                   known: Sequence[int] = ()) -> list[int]:
    """A name for each full block of a sequence holding `tokens`: a hash of its tokens and of the name before it (so
    of every token up to its end), and of `salt` (what else decides the K/V: a sequence's LoRA scales). Python's
    hash of ints and tuples is the same in every process, so a remote front and its host agree. `known`: the names
    of the first blocks, already computed for these tokens and salt (only the blocks after them are hashed)."""
    out, name = list(known), (known[-1] if known else hash(salt))
    for i in range(len(known) * block_size, len(tokens) - block_size + 1, block_size):
        name = hash((name, *tokens[i:i + block_size]))
        out.append(name)
    return out


class BlockTable:
    def __init__(self, n_seqs: int, n_blocks: int, block_size: int = BLOCK_SIZE):
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"a pool needs blocks: {n_blocks} of {block_size} positions")
        self.block_size = block_size
        self.n_blocks = n_blocks
        self.tables: list[list[int]] = [[] for _ in range(n_seqs)]
        self.refs = [0] * n_blocks
        self._free = list(range(n_blocks - 1, -1, -1))  # pop() hands out the lowest ids first
        self._name_of: dict[int, int] = {}  # block -> the content hash it is cached under (`cache`)
        self._block_of: dict[int, int] = {}  # content hash -> block
        self._cached: dict[int, None] = {}  # named blocks no sequence holds, least recently given up first

    @property
    def free(self) -> int:
        """Blocks a write may take: the free list and the cached blocks no sequence holds."""
        return len(self._free) + len(self._cached)

    @property
    def used(self) -> int:
        return self.n_blocks - self.free

    @property
    def n_cached(self) -> int:
        """Blocks cached by content (held by a sequence or not)."""
        return len(self._name_of)

    def cache(self, seq: int, names: Sequence[int]) -> None:
        """Name seq's first full blocks by `names` (content_hashes of what it holds), so `attach` finds them. A name
        another block has already keeps that block (the first one cached stays)."""
        table = self.tables[seq]
        for block, name in zip(table, names[:len(table)], strict=False):
            if block not in self._name_of and name not in self._block_of:
                self._name_of[block] = name
                self._block_of[name] = block

    def cached_run(self, names: Sequence[int]) -> int:
        """How many of `names`, from the first, name cached blocks."""
        n = 0
        while n < len(names) and names[n] in self._block_of:
            n += 1
        return n

    def cached_blocks(self, names: Sequence[int]) -> list[int]:
        """The cached blocks of the longest run of `names` from the first."""
        return [self._block_of[name] for name in names[:self.cached_run(names)]]

    def attach(self, seq: int, names: Sequence[int]) -> int:
        """seq, holding nothing, takes the cached blocks of the longest run of `names` from the first; how many."""
        table, refs = self.tables[seq], self.refs
        assert not table, "attach to an empty sequence"
        for block in self.cached_blocks(names):
            if refs[block] == 0:
                del self._cached[block]
            refs[block] += 1
            table.append(block)
        return len(table)

    def need(self, seq: int, start: int, end: int) -> int:
        """Free blocks a write of positions [start, end) of seq would take: blocks past its table, and a private
        copy of each block it writes into that another sequence holds too or that is cached by content. (start <= its
        length.)"""
        if end <= start:
            return 0
        table, b, refs, named = self.tables[seq], self.block_size, self.refs, self._name_of
        n_after = (end + b - 1) // b
        n = n_after - len(table) if n_after > len(table) else 0
        for i in range(start // b, min(n_after, len(table))):  # (a loop: on the step path, for a row or a few)
            if refs[table[i]] > 1 or table[i] in named:
                n += 1
        return n

    def positions_within(self, seq: int, start: int, blocks: int) -> int:
        """The most positions from start on that a write of seq can take with `blocks` free blocks."""
        table, b = self.tables[seq], self.block_size
        first = start // b
        n = 0  # blocks of the table from `first` on that the write can use
        while first + n < len(table):
            copied = self.refs[table[first + n]] > 1 or table[first + n] in self._name_of
            if copied and blocks == 0:
                break
            blocks -= copied
            n += 1
        if first + n == len(table):  # past the table: a new block per free one
            n += blocks
        return max(0, (first + n) * b - start)

    def write(self, seq: int, start: int, end: int, slots: list[int] | None = None) -> list[tuple[int, int]]:
        """Give seq blocks for positions [start, end), after which it ends at `end` (a write ending before its old
        end drops what followed, as the ledger counts lengths); those positions' pool slots are appended to
        `slots`. Returns the (shared or cached block, private copy) pairs whose contents the caller copies before
        writing (a cached block keeps its contents for attach). The caller checked need() against free."""
        table, b, refs = self.tables[seq], self.block_size, self.refs
        n_after = (end + b - 1) // b
        if (end - start == 1 and n_after == len(table) and refs[table[-1]] == 1
                and table[-1] not in self._name_of):  # a decode row in its own block
            if slots is not None:
                slots.append(table[-1] * b + start % b)
            return []
        if len(table) > n_after:
            self._release(table, n_after)
        copies = []
        for i in range(start // b, len(table)):
            if refs[table[i]] > 1 or table[i] in self._name_of:
                new = self._take()
                copies.append((table[i], new))
                self._drop(table[i])
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

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        else:  # the cached block given up longest ago
            block = next(iter(self._cached))
            del self._cached[block]
            self._forget(block)
        self.refs[block] = 1
        return block

    def _forget(self, block: int) -> None:
        del self._block_of[self._name_of.pop(block)]

    def _release(self, table: list[int], n_keep: int) -> None:
        while len(table) > n_keep:
            self._drop(table.pop())

    def _drop(self, block: int) -> None:
        """One holder fewer: a block no sequence holds goes back to the free list, or among the cached ones."""
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self._name_of:
                self._cached[block] = None
            else:
                self._free.append(block)
