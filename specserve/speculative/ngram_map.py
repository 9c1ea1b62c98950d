"""ngram-map-k and ngram-map-k4v: a map from key n-grams to the m-grams that followed them.

Follows llama.cpp's `common_ngram_map_draft` / `common_ngram_map_accept` (seed
`common/ngram-map.cpp`), with the documented behaviour where the seed's code differs from its
docs (see docs/speculative.md in the seed and our spec):

* key-only mode (`ngram-map-k`) also honours `min_hits` and also remembers how many tokens of
  its last draft were accepted;
* k4v drafts the tokens of the dominant value m-gram (the docs: "it is used as the draft"),
  which the seed's code only does when that value is also the one after the latest match;
* each occurrence of a key is counted once (the seed rescans the previous match position).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.speculative.base import SpecParams, Speculator
from specserve.speculative.ngram_index import NgramIndex

MAX_VALUES = 4  # value m-grams tracked per key
MAX_COUNT = 16380  # hit and value counts saturate here (they are uint16 in the seed)


@dataclass
class NgramValue:
    """One m-gram seen after a key, stored as its position in the history."""

    value_idx: int = 0  # start of the m-gram in the history; 0 = free slot (0 can never be a value)
    count: int = 0  # how often this m-gram followed the key
    n_accepted: int = 0  # tokens accepted when last used for a draft (starts at m)


@dataclass
class NgramKey:
    """Statistics of one key n-gram."""

    stat_idx: int = 0  # next history position to scan for occurrences (k4v statistics)
    hits: int = 0  # how often a lookup found this key
    values: list[NgramValue] = field(default_factory=list)


class NgramMap(Speculator):
    """Drafts the m tokens after an earlier occurrence of the current key n-gram.

    `key_only=True` is `ngram-map-k`: one value slot, drafts the tokens after the latest match
    once the key has `min_hits` hits. `key_only=False` is `ngram-map-k4v`: counts up to 4
    different m-grams per key and drafts only when one occurs at least 3x as often as all the
    others together. Both draft at most `min(m, accepted-at-last-use)` tokens.
    """

    _index: NgramIndex

    def __init__(self, params: SpecParams, key_only: bool | None = None):
        super().__init__()
        if key_only is None:
            key_only = params.type != "ngram-map-k4v"
        self.key_only = key_only
        self.name = "ngram_map_k" if key_only else "ngram_map_k4v"
        self.size_n = params.ngram_size_n
        self.size_m = params.ngram_size_m
        self.check_rate = params.ngram_check_rate
        self.min_hits = params.ngram_min_hits
        self._index = NgramIndex(self.size_n)
        self._reset()

    def _reset(self) -> None:
        self.keys: dict[tuple[int, ...], NgramKey] = {}
        self._idx_last_check = 0
        self._last_value: NgramValue | None = None  # value slot of the last draft, for accept()
        self._index.reset()

    def begin(self, prompt: list[int]) -> None:
        # Keys and values are positions into one history; a new generation's history is another.
        self._reset()

    def _propose(self, history: list[int], last_sampled: int, n_max: int) -> list[int]:
        self._last_value = None
        n, m = self.size_n, self.size_m
        cur_len = len(history)
        if cur_len < self._idx_last_check:
            self._reset()  # the history shrank without begin(): stored positions are stale
        if cur_len < 2 * n + m:
            return []
        if self._idx_last_check + self.check_rate > cur_len:
            return []
        self._idx_last_check = cur_len

        key = history[cur_len - n + 1:] + [last_sampled]
        # Latest earlier occurrence that still has m tokens after it inside the history.
        self._index.update(history)
        match_pos = self._index.latest(key, cur_len - n - m - 1)
        if match_pos is None:
            return []

        entry = self.keys.get(tuple(key))
        if entry is None:
            entry = self.keys[tuple(key)] = NgramKey(values=[NgramValue(n_accepted=m) for _ in range(MAX_VALUES)])
        entry.hits = min(entry.hits + 1, MAX_COUNT)
        if entry.hits < self.min_hits:
            return []

        if self.key_only:
            value = entry.values[0]
            start = match_pos + n
        else:
            self._count_values(history, key, entry, match_pos)
            dominant = self._dominant(entry)
            if dominant is None:
                return []
            value, start = dominant, dominant.value_idx
        self._last_value = value
        return history[start:start + min(m, value.n_accepted)]

    def _count_values(self, history: list[int], key: list[int], entry: NgramKey, match_pos: int) -> None:
        """Count the m-grams after each not yet counted occurrence of the key up to match_pos."""
        n, m = self.size_n, self.size_m
        for i in self._index.between(key, entry.stat_idx, match_pos):
            begin = i + n
            mgram = history[begin:begin + m]
            for value in entry.values:
                if value.value_idx == 0:  # free slot: a new m-gram
                    value.value_idx, value.count, value.n_accepted = begin, 0, m
                elif history[value.value_idx:value.value_idx + m] != mgram:
                    continue
                value.count = min(value.count + 1, MAX_COUNT)
                break
            # an m-gram that finds neither its slot nor a free one is not counted (4 slots only)
        entry.stat_idx = match_pos + 1

    @staticmethod
    def _dominant(entry: NgramKey) -> NgramValue | None:
        """The most frequent value if it occurs at least 3x as often as all others together."""
        best = max(entry.values, key=lambda v: v.count)  # first slot wins ties, as in the seed
        if best.count == 0:
            return None
        others = sum(v.count for v in entry.values) - best.count
        if others > 0 and best.count < 3 * others:
            return None
        return best

    def _accepted(self, n_accepted: int) -> None:
        if self._last_value is not None:
            self._last_value.n_accepted = n_accepted
            self._last_value = None
