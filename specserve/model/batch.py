"""Batch: the tokens of one forward pass, possibly from several sequences."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.model.token_tree import TokenTree


@dataclass
class Batch:
    """Rows of one forward pass. Rows of one sequence must be consecutive in the batch.

    tokens[i] is evaluated at positions[i] of sequence seq_ids[i]; logits are returned for
    the rows where want_logits[i] is true, in row order.

    A batch built from empty by add_sequence() alone knows its runs as it grows, each of consecutive positions
    (`gapless`): runs() and the ledger's checks then cost nothing per row.
    """

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    seq_ids: list[int] = field(default_factory=list)
    want_logits: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._runs: list[tuple[int, int, int, int]] | None = None if self.tokens else []
        self.trees: list[tuple[int, TokenTree]] = []  # (first row, tree) of each token tree (add_tree)

    @property
    def gapless(self) -> bool:
        """Each run's positions are consecutive (known from how the batch was built; False: not known)."""
        return self._runs is not None

    def add(self, token: int, position: int, seq: int, logits: bool = False) -> None:
        self._runs = None
        self.tokens.append(token)
        self.positions.append(position)
        self.seq_ids.append(seq)
        self.want_logits.append(logits)

    def add_row(self, token: int, position: int, seq: int, logits: bool) -> None:
        """A run of one row (a decode step's): add_sequence([token], position, seq, ...) without its lists."""
        runs = self._runs
        if runs is not None:
            if runs and runs[-1][0] == seq:
                self._runs = None
            else:
                runs.append((seq, len(self.tokens), len(self.tokens) + 1, position + 1))
        self.tokens.append(token)
        self.positions.append(position)
        self.seq_ids.append(seq)
        self.want_logits.append(logits)

    def add_sequence(self, tokens: list[int], start_pos: int, seq: int, logits: str = "last") -> None:
        """Append consecutive tokens of one sequence; logits for "last", "all" or "none" rows."""
        n = len(tokens)
        runs = self._runs
        if runs is not None and n:
            if runs and runs[-1][0] == seq:  # one run in two spans: one, if the second continues the first
                _, first, _, kv_len = runs[-1]
                if start_pos == kv_len:
                    runs[-1] = (seq, first, len(self.tokens) + n, start_pos + n)
                else:
                    self._runs = None
            else:
                runs.append((seq, len(self.tokens), len(self.tokens) + n, start_pos + n))
        self.tokens.extend(tokens)
        self.positions.extend(range(start_pos, start_pos + n))
        self.seq_ids.extend([seq] * n)
        self.want_logits.extend([logits == "all"] * n)
        if logits == "last" and n:
            self.want_logits[-1] = True

    def add_tree(self, tree: TokenTree, start_pos: int, seq: int) -> None:
        """A token tree's nodes, written at positions start_pos.. of the sequence, each wanting its logits
        (model/token_tree.py)."""
        self.trees.append((len(self.tokens), tree))
        self.add_sequence(list(tree.tokens), start_pos, seq, "all")

    def tree_layout(self) -> tuple[list[int], list[int]] | None:
        """Per row, its rotary position (a token tree's node: where its depth puts it, before the position it is
        written at) and the tree rows it must not see (TokenTree.hidden_bits); None where the batch holds no
        branching tree."""
        trees = [(first, tree) for first, tree in self.trees if not tree.is_chain]
        if not trees:
            return None
        rope, hidden = list(self.positions), [0] * len(self.tokens)
        for first, tree in trees:
            for i, (depth, bits) in enumerate(zip(tree.depths(), tree.hidden_bits(), strict=True)):
                rope[first + i] += depth - i
                hidden[first + i] = bits - (bits >> 63 << 64)  # (as an int64)
        return rope, hidden

    def __len__(self) -> int:
        return len(self.tokens)

    def runs(self) -> list[tuple[int, int, int, int]]:
        """(seq, start_row, end_row, kv_len) per block of consecutive rows of one sequence."""
        if self._runs is not None:
            return list(self._runs)
        out: list[tuple[int, int, int, int]] = []
        start = 0
        n = len(self.tokens)
        for i in range(1, n + 1):
            if i == n or self.seq_ids[i] != self.seq_ids[start]:
                out.append((self.seq_ids[start], start, i, max(self.positions[start:i]) + 1))
                start = i
        return out

    def logit_rows(self) -> list[int]:
        return [i for i, want in enumerate(self.want_logits) if want]


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists (KV-cache reuse)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
