"""Token trees: several draft continuations of one sequence verified in one forward pass.

Node 0 is the root (the sequence's next token, as a plain decode row); every other node continues its parent. The
candidates are merged into a trie, so continuations that start alike share their rows. The nodes are laid out in
depth-first order with the first candidate's path first: node i is written at cache position start + i (the rows
are one gapless run to the KV ledger), is rotated as position start + depth(i), and attends to the cache before
`start` and to its own ancestors only. When the accepted path is the first candidate's, its K/V already sit where
they belong; otherwise the runner moves the path's rows down (Runner.kv_compact).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MAX_TREE_NODES = 64  # a row's mask of the tree's earlier nodes is one 64-bit word


@dataclass(frozen=True, slots=True)
class TokenTree:
    tokens: tuple[int, ...]  # per node; tokens[0] is the root's
    parents: tuple[int, ...]  # per node, the parent's index (< the node's); -1 for the root

    def __post_init__(self) -> None:
        if not 0 < len(self.tokens) <= MAX_TREE_NODES or len(self.parents) != len(self.tokens):
            raise ValueError(f"a token tree holds 1..{MAX_TREE_NODES} nodes, each with a parent")
        if self.parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(self.parents) if i):
            raise ValueError("a token tree's nodes come after their parents, the root first")

    @classmethod
    def merge(cls, root: int, candidates: Sequence[Sequence[int]], most: int = MAX_TREE_NODES) -> TokenTree:
        """The trie of `candidates` (each continues `root`), in order of preference, cut to `most` nodes: the
        first candidate's path comes first, and a later candidate adds only the nodes it does not share."""
        children: list[dict[int, int]] = [{}]
        tokens, parents = [root], [-1]
        for candidate in candidates:
            node = 0
            for token in candidate:
                child = children[node].get(token)
                if child is None:
                    if len(tokens) >= most:
                        break
                    child = len(tokens)
                    children[node][token] = child
                    children.append({})
                    tokens.append(token)
                    parents.append(node)
                node = child
        return cls(tuple(tokens), tuple(parents))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        """Each node continues the one before it: a plain draft, verified as today."""
        return all(p == i - 1 for i, p in enumerate(self.parents) if i)

    def depths(self) -> list[int]:
        depth = [0] * len(self.parents)
        for i, p in enumerate(self.parents):
            if i:
                depth[i] = depth[p] + 1
        return depth

    def hidden_bits(self) -> list[int]:
        """Per node, the earlier nodes it must not see: bit j set where node i - j is not one of its ancestors (a
        row attends to every cache position before the tree and to its own path)."""
        out = []
        ancestors: list[int] = []
        for i, p in enumerate(self.parents):
            seen = (ancestors[p] if p >= 0 else 0) | 1 << i
            ancestors.append(seen)
            out.append(sum(1 << (i - j) for j in range(i) if not seen >> j & 1))
        return out

    def walk(self, picked: Sequence[int]) -> tuple[list[int], list[int]]:
        """Greedy verification: picked[i] is the target's token after node i. The accepted path (node indices from
        the root) and the tokens it yields (the accepted nodes' tokens after the root, then the next one)."""
        children: dict[tuple[int, int], int] = {}
        for i in range(len(self.parents) - 1, 0, -1):  # (the earlier of equal siblings wins; merge makes none)
            children[(self.parents[i], self.tokens[i])] = i
        path = [0]
        while (child := children.get((path[-1], picked[path[-1]]))) is not None:
            path.append(child)
        return path, [self.tokens[i] for i in path[1:]] + [picked[path[-1]]]

    def cut(self, n: int) -> TokenTree:
        """Its first n nodes (n >= 1): a tree still, as parents come first."""
        return self if n >= len(self.tokens) else TokenTree(self.tokens[:n], self.parents[:n])
