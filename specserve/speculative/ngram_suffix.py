"""ngram-suffix: copy what followed the longest earlier match of the history's suffix.

Not one of llama.cpp's types: the suffix-match idea of prompt-lookup and SuffixDecoding drafters.
ngram-simple and ngram-map look up one fixed key length, so a long key rarely matches on edited
text while a short one picks the wrong occurrence (the latest "\\n    " rather than the one whose
context matches). This type takes the longest suffix (up to n tokens, down to one) that occurred
before, the latest such occurrence, and lets the match length set the draft length: a one-token
match drafts a few tokens (a few-row verify step costs little more than a decode step), a long
match copies long. Replaying the greedy outputs of the workload prompts offline, it predicted 1.2x
ngram-map-k's tokens per forward pass on the code edits and 1.7x on the quoting prompts.
"""

from __future__ import annotations

from specserve.speculative.base import SpecParams, Speculator
from specserve.speculative.ngram_index import HistoryIndex

# A match of k tokens earns a draft of k + DRAFT_BEYOND_MATCH tokens (at most m, at most n_max).
DRAFT_BEYOND_MATCH = 3
BULK = 32  # index more new tokens than this per k-gram length, fewer per position
TAIL = 16  # a draft compares up to this many unindexed positions directly, indexes more first
LONGEST = 32  # the longest suffix looked up, whatever n says: the index costs O(longest) a token
ALTERNATIVES = 2  # a token tree's branches from shorter matches, besides the longest match's


class SuffixIndex(HistoryIndex):
    """The latest end position of every k-gram (k = 1..longest) of an append-only history.

    Keys are the k-grams' hashes (a collision is caught by comparing the tokens), so memory stays at
    a few dict entries per token and per k; update and lookup cost O(longest) per token.
    """

    def __init__(self, longest: int):
        self.longest = longest
        self.reset()

    def reset(self) -> None:
        super().reset()
        self._latest: list[dict[int, int]] = [{} for _ in range(self.longest)]  # [k - 1]: hash -> end

    def update(self, history: list[int]) -> None:
        """Index the k-grams ending at the positions the history gained (all of it, if it is not a
        continuation of what was indexed)."""
        start = self._indexed_length(history)
        if len(history) - start > BULK:  # a prompt: the k-grams of each length at once (3x faster)
            for k, latest in enumerate(self._latest, start=1):
                first = max(start, k - 1)  # the first end a k-gram can have
                grams = zip(*(history[first - k + 1 + i:] for i in range(k)), strict=False)  # shortest: the last
                latest.update(zip(map(hash, grams), range(first, len(history)), strict=True))  # later ends win
        else:  # a few accepted tokens: per position (no setup per length)
            for end in range(start, len(history)):
                window = tuple(history[max(0, end - self.longest + 1):end + 1])
                for k, latest in enumerate(self._latest[:len(window)], start=1):
                    latest[hash(window[-k:])] = end
        self._indexed(history)

    def unindexed(self, history: list[int]) -> int:
        """Positions of `history` past what is indexed (all of it for another history)."""
        return len(history) - self._indexed_length(history)

    def earlier_end(self, history: list[int], last: int, k: int) -> int | None:
        """Latest indexed end of the k tokens ending with `last` (history's last k - 1, then last)."""
        suffix = history[len(history) - k + 1:] + [last]
        end = self._latest[k - 1].get(hash(tuple(suffix)))
        if end is None or end < k - 1 or history[end - k + 1:end + 1] != suffix:
            return None
        return end

    def longest_match(self, history: list[int], last: int) -> tuple[int, int] | None:
        """(k, end): the longest run of history's last k - 1 tokens then `last` (k <= longest) that
        ends at an earlier position, and the latest such end; None when `last` was never seen. The
        positions past what is indexed (a few accepted tokens, `prepare` indexes them while the device
        works) are compared directly: they are later than any indexed one, so they win ties."""
        indexed = self._indexed_length(history)  # (first: another history resets the index)
        found = self._indexed_match(history, last)
        suffix_end = len(history)  # `last` stands there
        for end in range(len(history) - 1, indexed - 1, -1):
            k = 0
            while (k < self.longest and end - k >= 0
                   and (history[end - k] == (last if k == 0 else history[suffix_end - k]))):
                k += 1
            if k and (found is None or k > found[0] or (k == found[0] and end > found[1])):
                found = (k, end)
        return found

    def _indexed_match(self, history: list[int], last: int) -> tuple[int, int] | None:
        """longest_match among the indexed ends (the history's k-grams checked, the index's ends trusted)."""
        end = self.earlier_end(history, last, 1)
        if end is None:
            return None
        # A run that occurred before contains shorter ones that did too: binary search its length.
        lo, hi = 1, min(self.longest, len(history))
        while lo < hi:
            mid = (lo + hi + 1) // 2
            found = self.earlier_end(history, last, mid)
            if found is None:
                hi = mid - 1
            else:
                lo, end = mid, found
        return lo, end


class NgramSuffix(Speculator):
    """Draft = the tokens after the latest earlier occurrence of the longest matching suffix."""

    name = "ngram_suffix"
    _index: SuffixIndex

    def __init__(self, params: SpecParams):
        super().__init__()
        self.size_m = params.ngram_size_m  # most tokens copied after a match
        self._index = SuffixIndex(min(params.ngram_size_n, LONGEST))  # longest suffix looked up
        self._memo: tuple[int, int, tuple[int, int] | None] | None = None  # (history length, last, match)

    def begin(self, prompt: list[int]) -> None:
        self._index.reset()
        self._memo = None

    def match(self, history: list[int], last_sampled: int) -> tuple[int, int] | None:
        """(k, end) of the history's longest earlier run ending in last_sampled (SuffixIndex.longest_match),
        kept for the same call again (shared_suffix.py compares its match with it first)."""
        memo = self._memo
        if memo is not None and memo[0] == len(history) and memo[1] == last_sampled:
            return memo[2]
        if self._index.unindexed(history) > TAIL:  # a prompt, or prepare() was not called
            self._index.update(history)
        found = self._index.longest_match(history, last_sampled)
        self._memo = (len(history), last_sampled, found)
        return found

    def alternatives(self, history: list[int], last_sampled: int, n_max: int, first: list[int]) -> list[list[int]]:
        """What followed the latest earlier occurrences of shorter suffixes, where those went another way than the
        longest match's (at most ALTERNATIVES of them): a token tree's other branches."""
        match = self.match(history, last_sampled)
        if match is None or not first:
            return []
        k, end = match
        out, starts = [], {first[0]}
        for shorter in range(k - 1, 0, -1):
            other = self._index.earlier_end(history, last_sampled, shorter)
            if other is None or other == end or other + 1 >= len(history):
                continue
            tokens = history[other + 1:other + 1 + min(n_max, self.size_m, shorter + DRAFT_BEYOND_MATCH)]
            if tokens[0] not in starts:
                starts.add(tokens[0])
                out.append(tokens)
                if len(out) == ALTERNATIVES:
                    break
        self.stats.gen_tokens += sum(map(len, out))
        return out

    def _propose(self, history: list[int], last_sampled: int, n_max: int) -> list[int]:
        match = self.match(history, last_sampled)
        if match is None:
            return []
        k, end = match
        n = min(n_max, self.size_m, k + DRAFT_BEYOND_MATCH)
        draft = history[end + 1:end + 1 + n]
        if len(draft) < n and end + 1 + len(draft) == len(history):
            draft.append(last_sampled)  # the match ended just before the last sampled token
        return draft
