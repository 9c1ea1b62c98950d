"""ngram-map-k and ngram-map-k4v drafting rules (seed common/ngram-map.cpp + docs/speculative.md)."""

from __future__ import annotations

from specserve.speculative.base import SpecParams
from specserve.speculative.ngram_map import MAX_COUNT, NgramKey, NgramMap


def first_key(spec: NgramMap) -> NgramKey:
    """The statistics of the first key the map stored."""
    return next(iter(spec.keys.values()))

def make(kind: str, n: int, m: int, min_hits: int = 1, check_rate: int = 1) -> NgramMap:
    params = SpecParams(type=kind, ngram_size_n=n, ngram_size_m=m, ngram_min_hits=min_hits,
                        ngram_check_rate=check_rate)
    return NgramMap(params.validate())


def test_names_and_modes() -> None:
    k = make("ngram-map-k", 2, 2)
    k4v = make("ngram-map-k4v", 2, 2)
    assert (k.name, k.key_only) == ("ngram_map_k", True)
    assert (k4v.name, k4v.key_only) == ("ngram_map_k4v", False)
    assert k4v.stats.line(k4v.name).startswith("statistics ngram_map_k4v:")


# ---- ngram-map-k ------------------------------------------------------------------------------


def test_k_history_too_short() -> None:
    # needs at least 2n + m = 6 tokens
    spec = make("ngram-map-k", 2, 2)
    assert spec.draft([1, 2, 3, 4, 1], 2, n_max=16) == []
    assert spec.draft([9, 1, 2, 3, 4, 1], 2, n_max=16) == [3, 4]


def test_k_match_needs_m_tokens_after_it_in_history() -> None:
    # key [1, 2] occurs at 1 and 5; the one at 5 has only 1 token after it (< m), so 1 is used
    spec = make("ngram-map-k", 2, 2)
    assert spec.draft([9, 1, 2, 3, 4, 1, 2, 5, 1], 2, n_max=16) == [3, 4]


def test_k_keys_have_hit_counts() -> None:
    spec = make("ngram-map-k", 2, 2)
    spec.draft([9, 1, 2, 3, 4, 1], 2, n_max=16)
    spec.draft([9, 1, 2, 3, 4, 1, 2, 5, 1], 2, n_max=16)
    assert len(spec.keys) == 1
    assert spec.keys[(1, 2)].hits == 2


def test_k_applies_min_hits() -> None:
    # the seed's code drafts in key-only mode before checking min_hits; the docs (and we) do not
    spec = make("ngram-map-k", 2, 2, min_hits=2)
    assert spec.draft([9, 1, 2, 3, 4, 1], 2, n_max=16) == []  # first hit
    assert spec.draft([9, 1, 2, 3, 4, 1, 2, 5, 1], 2, n_max=16) == [3, 4]  # second hit
    assert spec.stats.calls == 2 and spec.stats.gen_drafts == 1


def test_k_remembers_accepted_count() -> None:
    # the seed's code never records it in key-only mode; the docs (and we) do
    spec = make("ngram-map-k", 2, 3)
    assert spec.draft([9, 1, 2, 3, 4, 5, 1], 2, n_max=16) == [3, 4, 5]
    spec.accept(1)
    assert first_key(spec).values[0].n_accepted == 1
    assert spec.draft([9, 1, 2, 3, 4, 5, 1, 2, 3, 8, 1], 2, n_max=16) == [3]  # min(m, 1)
    spec.accept(0)
    assert spec.draft([9, 1, 2, 3, 4, 5, 1, 2, 3, 8, 1, 2, 7, 6, 1], 2, n_max=16) == []  # min(m, 0)


def test_k_accept_without_pending_draft_is_ignored() -> None:
    spec = make("ngram-map-k", 2, 3)
    history = [9, 1, 2, 3, 4, 5, 1]
    assert spec.draft(history, 2, n_max=16, n_min=4) == []  # [3, 4, 5] dropped by n_min
    spec.accept(0)  # must not reach the value's accepted count
    assert first_key(spec).values[0].n_accepted == 3
    assert spec.stats.acc_drafts == 0


def test_k_check_rate() -> None:
    spec = make("ngram-map-k", 1, 1, check_rate=2)
    # key [1] at position 1 with value 5; history grows by one token per call
    assert spec.draft([0, 1, 5, 7], 1, n_max=16) == [5]  # searched at length 4
    assert spec.draft([0, 1, 5, 7, 1], 1, n_max=16) == []  # 1 token since: skipped
    assert spec.draft([0, 1, 5, 7, 1, 1], 1, n_max=16) == [5]  # 2 tokens since: searched


def test_begin_clears_positions() -> None:
    spec = make("ngram-map-k", 2, 2)
    spec.draft([9, 1, 2, 3, 4, 1], 2, n_max=16)
    assert len(spec.keys) == 1
    spec.begin([4, 4, 4])
    assert spec.keys == {}


# ---- ngram-map-k4v ----------------------------------------------------------------------------


def test_k4v_three_times_dominance_passes() -> None:
    # key [1] followed by 5, 5, 5, 6: 3 >= 3 * 1 -> the dominant value 5 is the draft, even though
    # the latest match (position 7) is followed by 6 (the seed's code would copy 6)
    spec = make("ngram-map-k4v", 1, 1)
    assert spec.draft([0, 1, 5, 1, 5, 1, 5, 1, 6, 9], 1, n_max=16) == [5]
    assert [(v.value_idx, v.count) for v in first_key(spec).values] == [(2, 3), (8, 1), (0, 0), (0, 0)]


def test_k4v_below_three_times_gives_no_draft() -> None:
    # 5 twice, 6 once: 2 < 3 * 1
    spec = make("ngram-map-k4v", 1, 1)
    assert spec.draft([0, 1, 5, 1, 5, 1, 6, 9], 1, n_max=16) == []


def test_k4v_dominance_is_against_all_others_together() -> None:
    # 6x value 5 against 1x 6 and 1x 7: 6 >= 3 * 2 passes; 5x against the same two: 5 < 6 fails
    six = [0] + [1, 5] * 6 + [1, 6, 1, 7, 9, 9]
    five = [0] + [1, 5] * 5 + [1, 6, 1, 7, 9, 9]
    assert make("ngram-map-k4v", 1, 1).draft(six, 1, n_max=16) == [5]
    assert make("ngram-map-k4v", 1, 1).draft(five, 1, n_max=16) == []


def test_k4v_values_are_whole_m_grams() -> None:
    # (5, 6) three times, (5, 7) once: same first token, different m-grams
    history = [0, 1, 5, 6, 1, 5, 7, 1, 5, 6, 1, 5, 6, 1, 3, 3]
    spec = make("ngram-map-k4v", 1, 2)
    assert spec.draft(history, 1, n_max=16) == [5, 6]
    tie = [0, 1, 5, 6, 1, 5, 7, 1, 5, 7, 1, 5, 6, 1, 3, 3]
    assert make("ngram-map-k4v", 1, 2).draft(tie, 1, n_max=16) == []


def test_k4v_counts_each_occurrence_once() -> None:
    spec = make("ngram-map-k4v", 1, 1)
    history = [0, 1, 5, 1, 5, 1, 5, 1, 6, 9]
    spec.draft(history, 1, n_max=16)
    spec.draft(history + [1, 5, 2], 1, n_max=16)  # one new occurrence (position 10, value 5)
    by_token = {history[v.value_idx]: v.count for v in first_key(spec).values if v.count}
    assert by_token == {5: 4, 6: 1}
    spec.draft(history + [1, 5, 2, 4], 8, n_max=16)  # another key: [1]'s counts stay
    assert {history[v.value_idx]: v.count for v in first_key(spec).values if v.count} == {5: 4, 6: 1}


def test_k4v_only_four_values_per_key() -> None:
    history = [0, 1, 2, 1, 3, 1, 4, 1, 5] + [1, 6] * 6 + [1, 9, 9]
    spec = make("ngram-map-k4v", 1, 1)
    assert spec.draft(history, 1, n_max=16) == []  # 6 never gets a slot: 1 vs 3 others
    values = first_key(spec).values
    assert len(values) == 4
    assert [history[v.value_idx] for v in values] == [2, 3, 4, 5]
    assert [v.count for v in values] == [1, 1, 1, 1]


def test_k4v_min_hits() -> None:
    spec = make("ngram-map-k4v", 1, 1, min_hits=2)
    history = [0, 1, 5, 1, 5, 1, 5, 9]
    assert spec.draft(history, 1, n_max=16) == []
    assert spec.draft(history + [1], 7, n_max=16) == []  # another key
    assert spec.draft(history + [1, 7], 1, n_max=16) == [5]  # second hit of key [1]


def test_k4v_remembers_accepted_count_per_value() -> None:
    history = [0, 1, 5, 6, 1, 5, 6, 1, 5, 6, 3, 3]
    spec = make("ngram-map-k4v", 1, 2)
    assert spec.draft(history, 1, n_max=16) == [5, 6]
    spec.accept(1)
    dominant = max(first_key(spec).values, key=lambda v: v.count)
    assert dominant.n_accepted == 1
    assert spec.draft(history + [1, 5, 4], 1, n_max=16) == [5]  # min(m, 1)
    spec.accept(1)
    assert (spec.stats.gen_tokens, spec.stats.acc_tokens) == (3, 2)


def test_counts_saturate() -> None:
    # 17000 occurrences of key [1] followed by 5: the value count stops at 16380
    history = [0] + [1, 5] * 17000
    spec = make("ngram-map-k4v", 1, 1)
    assert spec.draft(history, 1, n_max=16) == [5]
    entry = first_key(spec)
    assert entry.values[0].count == MAX_COUNT == 16380
    entry.hits = MAX_COUNT - 1
    assert spec.draft(history + [1, 5], 1, n_max=16) == [5]
    assert entry.hits == MAX_COUNT
    assert spec.draft(history + [1, 5, 1, 5], 1, n_max=16) == [5]
    assert entry.hits == MAX_COUNT
    assert entry.values[0].count == MAX_COUNT
