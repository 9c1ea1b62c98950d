"""ngram-simple drafting rules, the shared Speculator bookkeeping, and SpecParams validation."""

from __future__ import annotations

import pytest

from specserve.errors import SpecserveError
from specserve.speculative.base import SpecParams
from specserve.speculative.ngram_simple import NgramSimple


def make(n: int = 2, m: int = 3, check_rate: int = 1) -> NgramSimple:
    params = SpecParams(type="ngram-simple", ngram_size_n=n, ngram_size_m=m, ngram_check_rate=check_rate)
    return NgramSimple(params.validate())


def test_name_is_the_statistics_label() -> None:
    spec = make()
    assert spec.name == "ngram_simple"
    assert spec.stats.line(spec.name).startswith("statistics ngram_simple: #calls = 0,")


def test_copies_the_tokens_after_the_match() -> None:
    # pattern = last n-1 history tokens + last sampled = [1, 2]; it occurred at position 1
    assert make().draft([9, 1, 2, 3, 4, 5, 1], 2, n_max=16) == [3, 4, 5]


def test_history_too_short() -> None:
    # the seed searches only when len(history) > n + m + 1 (= 6 here)
    spec = make()
    assert spec.draft([1, 2, 3, 4, 5, 1], 2, n_max=16) == []
    assert spec.draft([0, 1, 2, 3, 4, 5, 1], 2, n_max=16) == [3, 4, 5]


def test_latest_match_wins() -> None:
    history = [0, 1, 2, 7, 7, 7, 1, 2, 8, 8, 8, 1]
    assert make().draft(history, 2, n_max=16) == [8, 8, 8]


def test_position_zero_is_never_a_match() -> None:
    assert make().draft([1, 2, 3, 4, 5, 6, 7, 1], 2, n_max=16) == []


def test_fewer_than_n_copyable_tokens_gives_no_draft() -> None:
    # the latest match at position 6 leaves 1 token (< n = 2) to copy; the earlier one is not used
    assert make().draft([5, 1, 2, 7, 9, 0, 1, 2, 1], 2, n_max=16) == []


def test_pattern_of_one_token() -> None:
    assert make(n=1, m=2).draft([4, 5, 6, 7, 5], 5, n_max=16) == [6, 7]


def test_copy_is_limited_to_m() -> None:
    history = [0, 1, 2] + list(range(10, 20)) + [1]
    assert make(m=4).draft(history, 2, n_max=16) == [10, 11, 12, 13]


def test_check_rate() -> None:
    spec = make(check_rate=3)
    base = [0, 1, 2, 3, 4, 5, 1]
    assert spec.draft(base, 2, n_max=16) == [3, 4, 5]  # searched at length 7
    assert spec.draft(base + [2], 3, n_max=16) == []  # 1 token since the last search
    assert spec.draft(base + [2, 3], 4, n_max=16) == []  # 2 tokens
    assert spec.draft(base + [2, 3, 4], 5, n_max=16) == [1, 2, 3]  # 3 tokens: searched again
    assert spec.stats.calls == 4 and spec.stats.gen_drafts == 2


def test_short_history_does_not_consume_the_check_rate() -> None:
    spec = make(check_rate=2)
    assert spec.draft([1, 2, 3, 4, 5, 1], 2, n_max=16) == []  # too short, no search
    assert spec.draft([0, 1, 2, 3, 4, 5, 1], 2, n_max=16) == [3, 4, 5]


def test_begin_resets_the_check_mark() -> None:
    spec = make(check_rate=5)
    assert spec.draft([0, 1, 2, 3, 4, 5, 1], 2, n_max=16) == [3, 4, 5]
    h8 = [0, 1, 2, 3, 4, 5, 1, 2]
    assert spec.draft(h8, 3, n_max=16) == []  # only 1 token since the last search
    spec.begin(h8)
    assert spec.draft(h8, 3, n_max=16) == [4, 5, 1]


def test_shorter_history_is_a_new_sequence() -> None:
    spec = make(check_rate=5)
    assert spec.draft([0, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1], 2, n_max=16) == [3, 4, 5]
    # a history shorter than at the last search cannot be the same sequence: search again
    assert spec.draft([0, 1, 2, 3, 4, 5, 1], 2, n_max=16) == [3, 4, 5]


def test_n_max_trims_and_n_min_drops() -> None:
    spec = make()
    history = [0, 1, 2, 3, 4, 5, 1]
    assert spec.draft(history, 2, n_max=2) == [3, 4]
    assert spec.draft(history + [2, 3], 4, n_max=16, n_min=4) == []  # would be [5, 1, 2]: too short
    assert spec.draft(history, 2, n_max=0) == []
    assert spec.stats.calls == 3
    assert spec.stats.gen_drafts == 1 and spec.stats.gen_tokens == 2


def test_statistics_follow_accept() -> None:
    spec = make()
    history = [0, 1, 2, 3, 4, 5, 1]
    spec.draft(history, 2, n_max=16)
    spec.accept(2)
    spec.draft(history + [2, 3, 4, 9], 1, n_max=16)  # [1, 2]? no: pattern [9, 1] is new -> no draft
    spec.accept(5)  # no draft pending: ignored
    spec.draft(history + [2, 3, 4], 5, n_max=16)
    spec.accept(0)
    assert (spec.stats.calls, spec.stats.gen_drafts, spec.stats.acc_drafts) == (3, 2, 1)
    assert (spec.stats.gen_tokens, spec.stats.acc_tokens) == (6, 2)
    assert spec.stats.line(spec.name) == (
        "statistics ngram_simple: #calls = 3, #gen drafts = 2, #acc drafts = 1, #gen tokens = 6, #acc tokens = 2"
    )


# ---- SpecParams ---------------------------------------------------------------------------------


def test_spec_params_defaults_are_valid() -> None:
    p = SpecParams().validate()
    assert (p.type, p.n_max, p.n_min, p.p_min) == ("none", 16, 0, 0.75)
    assert (p.ngram_size_n, p.ngram_size_m, p.ngram_check_rate, p.ngram_min_hits) == (12, 48, 1, 1)


@pytest.mark.parametrize("name", ["ngram_size_n", "ngram_size_m"])
def test_spec_params_ngram_sizes_range(name: str) -> None:
    assert getattr(SpecParams(**{name: 1}).validate(), name) == 1
    assert getattr(SpecParams(**{name: 1024}).validate(), name) == 1024
    for bad in (0, 1025, -3):
        with pytest.raises(SpecserveError, match=rf"{name} = {bad} is out of range \[1, 1024\]"):
            SpecParams(**{name: bad}).validate()


@pytest.mark.parametrize("name", ["ngram_check_rate", "ngram_min_hits"])
def test_spec_params_at_least_one(name: str) -> None:
    assert getattr(SpecParams(**{name: 1000}).validate(), name) == 1000
    with pytest.raises(SpecserveError, match=f"{name} = 0 is out of range >= 1"):
        SpecParams(**{name: 0}).validate()


def test_spec_params_other_checks() -> None:
    with pytest.raises(SpecserveError, match="unknown speculative type 'ngram-foo'"):
        SpecParams(type="ngram-foo").validate()
    with pytest.raises(SpecserveError, match="must be an integer"):
        SpecParams(ngram_size_n=2.5).validate()  # type: ignore[arg-type]
    with pytest.raises(SpecserveError, match="n_min .* must not exceed n_max"):
        SpecParams(n_max=4, n_min=5).validate()
    with pytest.raises(SpecserveError, match="n_max = -1"):
        SpecParams(n_max=-1).validate()
    with pytest.raises(SpecserveError, match="p_min"):
        SpecParams(p_min=1.5).validate()
    for t in ("none", "ngram-cache", "ngram-simple", "ngram-map-k", "ngram-map-k4v"):
        assert SpecParams(type=t).validate().type == t


def test_spec_params_overrides() -> None:
    base = SpecParams(type="ngram-simple")
    p = base.with_overrides(ngram_size_n=3, n_max=8)
    assert (p.ngram_size_n, p.n_max, base.ngram_size_n) == (3, 8, 12)
    with pytest.raises(SpecserveError, match="unknown speculative option"):
        base.with_overrides(bogus=1)
    with pytest.raises(SpecserveError, match="out of range"):
        base.with_overrides(ngram_size_m=0)


def test_ngram_index_matches_a_scan() -> None:
    """The incremental index answers as a backward scan of the history would, as the history grows
    and when it is replaced by another one."""
    import random

    from specserve.speculative.ngram_index import NgramIndex

    rng = random.Random(5)
    index = NgramIndex(3)
    history: list[int] = []
    for step in range(400):
        if step == 200:
            history = history[:50]  # another history: shorter, then growing again
        history.append(rng.randrange(4))
        index.update(history)
        key = [rng.randrange(4) for _ in range(3)]
        hi = rng.randrange(-1, len(history))
        scan = next((j for j in range(hi, 0, -1) if history[j:j + 3] == key and j + 3 <= len(history)), None)
        assert index.latest(key, hi) == scan
        lo = rng.randrange(0, len(history) + 1)
        assert index.between(key, lo, hi) == [j for j in range(lo, hi + 1) if history[j:j + 3] == key
                                              and j + 3 <= len(history)]
