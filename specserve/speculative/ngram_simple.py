"""ngram-simple: copy the m tokens that followed the latest earlier occurrence of the last n tokens.

The cheapest self-speculative method: no statistics, just a backward search of the history.
Semantics follow llama.cpp's `common_ngram_simple_draft` (seed `common/ngram-map.cpp`).
"""

from __future__ import annotations

from specserve.speculative.base import SpecParams, Speculator
from specserve.speculative.ngram_index import NgramIndex


class NgramSimple(Speculator):
    """Pattern = last n-1 history tokens + the last sampled token; draft = what followed it before."""

    name = "ngram_simple"

    def __init__(self, params: SpecParams):
        super().__init__()
        self.size_n = params.ngram_size_n  # length of the pattern looked up
        self.size_m = params.ngram_size_m  # most tokens copied after a match
        self.check_rate = params.ngram_check_rate  # search only every check_rate tokens
        self._idx_last_check = 0  # history length at the last search
        self._index: NgramIndex = NgramIndex(self.size_n)

    def begin(self, prompt: list[int]) -> None:
        self._idx_last_check = 0
        self._index.reset()

    def _propose(self, history: list[int], last_sampled: int, n_max: int) -> list[int]:
        n, m = self.size_n, self.size_m
        cur_len = len(history)
        if cur_len < self._idx_last_check:
            self._idx_last_check = 0  # a shorter history is a new sequence: the old mark is meaningless
        if self._idx_last_check + self.check_rate > cur_len:
            return []
        # The seed needs strictly more than n + m + 1 tokens before it searches at all.
        if cur_len <= n + m + 1:
            return []
        pattern = history[cur_len - n + 1:] + [last_sampled]
        self._idx_last_check = cur_len

        # The newest candidate that is not the current position itself; position 0 is never a match
        # (the seed uses 0 as "no match").
        self._index.update(history)
        match_pos = self._index.latest(pattern, cur_len - n - 1)
        if match_pos is None:
            return []
        copy_len = min(m, cur_len - (match_pos + n))
        if copy_len < n:
            return []  # too little follows the match to be worth a draft
        start = match_pos + n
        return history[start:start + copy_len]
