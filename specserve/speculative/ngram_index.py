"""Where each n-gram of a growing token history starts, kept up to date as the history grows.

ngram-simple and ngram-map look for the latest earlier occurrence of the current n-gram on every
draft call; scanning the history for it made a generation O(L^2) in Python (a 2k-token code-edit
prompt cost ~0.1 ms per drafted step). The index adds each new n-gram once and answers with a
binary search over that n-gram's positions.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right


class HistoryIndex:
    """What an index over one append-only history tracks: how much of it was indexed, and whether the
    history passed now continues that one (else it is another history: start over)."""

    def update(self, history: list[int]) -> None:
        """Index what the history gained since the last call (all of it for another history)."""
        raise NotImplementedError

    def reset(self) -> None:
        self._length = 0  # history length indexed so far
        self._last = -1  # history[_length - 1] then: a different token means another history

    def _indexed_length(self, history: list[int]) -> int:
        """How much of `history` is indexed already (0 after a reset for another history)."""
        if len(history) < self._length or (self._length and history[self._length - 1] != self._last):
            self.reset()
        return self._length

    def _indexed(self, history: list[int]) -> None:
        self._length = len(history)
        self._last = history[-1] if history else -1


class NgramIndex(HistoryIndex):
    """n-gram -> ascending start positions in one append-only history."""

    def __init__(self, n: int):
        self.n = n
        self.reset()

    def reset(self) -> None:
        super().reset()
        self._positions: dict[tuple[int, ...], list[int]] = {}

    def update(self, history: list[int]) -> None:
        """Index the n-grams the history gained since the last call (or all of it, if it is not a
        continuation of what was indexed)."""
        n = self.n
        for j in range(max(0, self._indexed_length(history) - n + 1), len(history) - n + 1):
            self._positions.setdefault(tuple(history[j:j + n]), []).append(j)
        self._indexed(history)

    def latest(self, ngram: list[int], hi: int, lo: int = 0) -> int | None:
        """The highest start j with lo < j <= hi; None if there is none."""
        positions = self._positions.get(tuple(ngram), ())
        i = bisect_right(positions, hi) - 1
        return positions[i] if i >= 0 and positions[i] > lo else None

    def between(self, ngram: list[int], lo: int, hi: int) -> list[int]:
        """Every start j with lo <= j <= hi, ascending."""
        positions = self._positions.get(tuple(ngram), [])
        return positions[bisect_left(positions, lo):bisect_right(positions, hi)]
