"""The cross-request suffix store: scoped, bounded, least recently used out first; and its speculator."""

from __future__ import annotations

import random

from specserve.speculative.base import SpecParams
from specserve.speculative.shared_suffix import KEY_LENGTHS, SharedSuffix, SuffixStore


def indexed(store: SuffixStore, scope: str) -> None:
    store.index_pending(scope, budget=1 << 30)


def test_a_request_drafts_what_followed_its_suffix_in_an_earlier_one() -> None:
    store = SuffixStore()
    rng = random.Random(1)
    doc = [rng.randrange(1000) for _ in range(300)]
    store.add("a", doc)
    indexed(store, "a")
    context = [7, 7, *doc[100:140]]  # its last 40 tokens ran in the earlier request, ending at 139
    k, tokens, end = store.lookup("a", context)  # type: ignore[misc]
    assert tokens == doc and end == 139 and k == 32  # extended backwards up to the longest suffix looked up
    assert store.lookup("a", [5000, 5001, 5002, 5003, 5004]) is None


def test_scopes_never_see_each_others_text() -> None:
    store = SuffixStore()
    doc = list(range(100, 200))
    store.add("key-a", doc)
    indexed(store, "key-a")
    indexed(store, "key-b")
    assert store.lookup("key-a", doc[:50]) is not None
    assert store.lookup("key-b", doc[:50]) is None
    spec_b = SharedSuffix(SpecParams(type="ngram-suffix", scope="key-b"), store)
    spec_b.begin(doc[:50])
    assert spec_b.draft(doc[:49], doc[49], 8) == []
    spec_a = SharedSuffix(SpecParams(type="ngram-suffix", scope="key-a"), store)
    spec_a.begin(doc[:50])
    assert spec_a.draft(doc[:49], doc[49], 8) == doc[50:58]


def test_the_least_recently_used_request_leaves_first_and_its_index_with_it() -> None:
    store = SuffixStore(max_tokens=250)
    docs = [list(range(i * 1000, i * 1000 + 100)) for i in range(3)]
    store.add("s", docs[0])
    store.add("s", docs[1])
    indexed(store, "s")
    assert store.lookup("s", docs[0][:20]) is not None  # a draft from docs[0]: it is now the most recent
    store.add("s", docs[2])  # 300 tokens > 250: docs[1] goes
    indexed(store, "s")
    assert store.sizes() == (2, 200)
    assert store.lookup("s", docs[1][:20]) is None
    assert store.lookup("s", docs[0][:20]) is not None and store.lookup("s", docs[2][:20]) is not None
    scope = store._scopes["s"]
    assert all((v >> 32) in scope.docs for v in scope.latest.values())  # no entry points at a dropped request
    assert len(scope.latest) == sum(len(d) - k + 1 for d in (docs[0], docs[2]) for k in KEY_LENGTHS)


def test_requests_are_indexed_a_slice_at_a_time_and_added_at_their_end() -> None:
    store = SuffixStore()
    spec = SharedSuffix(SpecParams(type="ngram-suffix", scope="s"), store)
    history = list(range(5000, 8000))
    spec.begin(history[:100])
    spec.prepare(history)
    spec.end(history)  # the task's tokens join the store, not indexed yet
    assert store.sizes() == (1, 3000)
    assert store.lookup("s", history[2900:2950]) is None
    for _ in range(3):
        store.index_pending("s", budget=1024)
    assert store.lookup("s", history[2900:2950]) is not None


def test_a_task_that_ended_between_drafts_joins_the_store_whole() -> None:
    """Turns that skip the speculators' bookkeeping (chained drafts under load) see nothing of the history; the
    task's end hands the slot's whole history to its chain, so the store gets its prompt and all it generated."""
    from types import SimpleNamespace

    from specserve.engine.slot_results import Settler
    from specserve.speculative.base import Chain

    store = SuffixStore()
    spec = SharedSuffix(SpecParams(type="ngram-suffix", scope="s"), store)
    history = list(range(5000, 5400))
    chain = Chain([spec])
    chain.begin(history[:100])  # no prepare, no draft after the prompt
    Settler._end_chain(object.__new__(Settler), SimpleNamespace(chain=chain, cache=history, chain_key=None, id=0))
    assert store.sizes() == (1, 400)
