"""shared-suffix: drafts from the text of earlier requests in the same scope.

SuffixDecoding (arXiv 2411.04975) keeps one suffix structure over the prompts and outputs of past requests,
and that is what pays in agent loops and batch jobs: a request writes what another one read or wrote. This
store keeps finished requests' tokens (prompt and output) per scope, at most `max_tokens` in all, dropping the
least recently used request first. A scope is what the server makes of the request's API key and the
`speculative.scope` the client names: requests of different scopes never draft from each other's text.

Each scope indexes the k-grams of its requests for a few key lengths (the latest end of each), so a lookup
finds the longest earlier occurrence of the slot's suffix among KEY_LENGTHS and its match is then extended
backwards token by token. New requests are indexed a slice at a time from `begin` and `prepare` (which runs
while the device works), not at the end of a request. In ngram-suffix's chain this type comes first and drafts
only on a match of 16 tokens or more that is longer than the slot's own history's (ngram_suffix.py), which drafts
otherwise.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from specserve.speculative.base import SpecParams, Speculator
from specserve.speculative.ngram_suffix import DRAFT_BEYOND_MATCH, LONGEST, NgramSuffix

KEY_LENGTHS = (32, 16)  # longest first: a match of 16+ tokens in another request beats one's own shorter ones
INDEX_SLICE = 1024  # tokens indexed per prepare() call
DEFAULT_TOKENS = 1 << 18  # tokens kept in all (about 3 index entries each)


@dataclass
class _Scope:
    docs: dict[int, list[int]] = field(default_factory=dict)
    latest: dict[int, int] = field(default_factory=dict)  # hash of (k, gram) -> doc << 32 | end
    pending: list[tuple[int, int]] = field(default_factory=list)  # (doc, next end to index)


class SuffixStore:
    """Finished requests' tokens by scope, bounded in tokens, least recently used out first. Thread-safe: the
    scheduler's thread adds, drafts and indexes; the server reads the sizes."""

    def __init__(self, max_tokens: int = DEFAULT_TOKENS):
        self.max_tokens = max_tokens
        self.tokens = 0
        self._scopes: dict[str, _Scope] = {}
        self._lru: OrderedDict[int, str] = OrderedDict()  # doc -> its scope, oldest first
        self._next_doc = 0
        self._lock = threading.Lock()

    def add(self, scope: str, tokens: list[int]) -> None:
        """Keep a finished request's tokens (indexed later, by index_pending)."""
        if not tokens or len(tokens) > self.max_tokens:
            return
        with self._lock:
            doc = self._next_doc
            self._next_doc += 1
            s = self._scopes.setdefault(scope, _Scope())
            s.docs[doc] = list(tokens)
            s.pending.append((doc, 0))
            self._lru[doc] = scope
            self.tokens += len(tokens)
            while self.tokens > self.max_tokens:
                self._evict()

    def _evict(self) -> None:
        doc, scope = self._lru.popitem(last=False)
        s = self._scopes[scope]
        tokens = s.docs.pop(doc)
        self.tokens -= len(tokens)
        s.pending = [(d, e) for d, e in s.pending if d != doc]
        for k in KEY_LENGTHS:
            for end in range(k - 1, len(tokens)):
                key = hash((k, *tokens[end - k + 1:end + 1]))
                if s.latest.get(key) == doc << 32 | end:
                    del s.latest[key]
        if not s.docs:
            del self._scopes[scope]

    def index_pending(self, scope: str, budget: int = INDEX_SLICE) -> None:
        """Index up to `budget` tokens of the scope's newest requests."""
        with self._lock:
            s = self._scopes.get(scope)
            while s is not None and s.pending and budget > 0:
                doc, start = s.pending[0]
                tokens = s.docs[doc]
                stop = min(len(tokens), start + budget)
                for k in KEY_LENGTHS:
                    first = max(start, k - 1)
                    grams = zip(*(tokens[first - k + 1 + i:stop] for i in range(k)), strict=False)
                    s.latest.update(zip((hash((k, *g)) for g in grams), (doc << 32 | e for e in range(first, stop)),
                                        strict=False))
                budget -= stop - start
                if stop == len(tokens):
                    s.pending.pop(0)
                else:
                    s.pending[0] = (doc, stop)

    def lookup(self, scope: str, context: list[int]) -> tuple[int, list[int], int] | None:
        """(k, tokens, end): the longest earlier run of the context's last k tokens (k >= the shortest key
        length) in the scope's requests, the request holding it and where the run ends there; None if none."""
        with self._lock:
            s = self._scopes.get(scope)
            shortest = KEY_LENGTHS[-1]  # a longer run ends with a shorter one: no hit there, none at all
            if s is None or len(context) < shortest or hash((shortest, *context[-shortest:])) not in s.latest:
                return None
            for k in KEY_LENGTHS:
                if len(context) < k:
                    continue
                suffix = context[-k:]
                value = s.latest.get(hash((k, *suffix)))
                if value is None:
                    continue
                doc, end = value >> 32, value & 0xFFFFFFFF
                tokens = s.docs.get(doc)
                if tokens is None or tokens[end - k + 1:end + 1] != suffix:
                    continue  # a hash collision
                self._lru.move_to_end(doc)
                while k < LONGEST and end - k >= 0 and k < len(context) and tokens[end - k] == context[-k - 1]:
                    k += 1
                return k, tokens, end
        return None

    def sizes(self) -> tuple[int, int]:
        """(requests, tokens) kept."""
        with self._lock:
            return len(self._lru), self.tokens


class SharedSuffix(Speculator):
    """Draft = what followed the longest earlier occurrence of the history's suffix in another request of the
    same scope. At the end of its task it adds the task's tokens to the store."""

    name = "shared_suffix"

    def __init__(self, params: SpecParams, store: SuffixStore, own: NgramSuffix | None = None):
        """own: the sequence's own-history drafter after it in the chain; a match there at least as long wins."""
        super().__init__()
        self.size_m = params.ngram_size_m
        self.scope = params.scope
        self.store = store
        self.own = own

    def begin(self, prompt: list[int]) -> None:
        self.store.index_pending(self.scope)

    def prepare(self, history: list[int]) -> None:
        self.store.index_pending(self.scope)

    def _propose(self, history: list[int], last_sampled: int, n_max: int) -> list[int]:
        match = self.store.lookup(self.scope, history[-LONGEST:] + [last_sampled])
        if match is None:
            return []
        k, tokens, end = match
        own = self.own.match(history, last_sampled) if self.own is not None else None
        if own is not None and own[0] >= k:
            return []
        n = min(n_max, self.size_m, k + DRAFT_BEYOND_MATCH)
        return tokens[end + 1:end + 1 + n]

    def end(self, history: list[int]) -> None:
        """The task is over: its tokens join the store (the slot's history: its prompt and what it kept)."""
        self.store.add(self.scope, history)
