"""ngram-cache: cache updates, the 3-level drafting thresholds, the file format, the speculator."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

import specserve.speculative.ngram_cache as nc
from specserve.errors import SpecserveError
from specserve.speculative.base import SpecParams
from specserve.speculative.ngram_cache import (
    NgramCache,
    NgramCacheSpeculator,
    draft_from_caches,
    load_cache,
    merge_cache,
    parse_cache,
    save_cache,
    serialize_cache,
    update_cache,
)


def record(ngram: tuple[int, ...], entries: list[tuple[int, int]]) -> bytes:
    """One record, byte by byte as documented: 4 int32 tokens (-1 padded), int32 k, k x (token, count)."""
    slots = list(ngram) + [-1] * (4 - len(ngram))
    data = struct.pack("<4i", *slots) + struct.pack("<i", len(entries))
    for token, count in entries:
        data += struct.pack("<ii", token, count)
    return data


def draft(inp: list[int], n: int = 8, context: NgramCache | None = None, dynamic: NgramCache | None = None,
          static: NgramCache | None = None) -> list[int]:
    return draft_from_caches(inp, n, context or {}, dynamic or {}, static or {})


# ---- updating ---------------------------------------------------------------------------------


def test_update_counts_every_size() -> None:
    cache: NgramCache = {}
    update_cache(cache, [1, 2, 3, 1, 2, 4], 1, 2)
    assert cache[(1,)] == {2: 2}
    assert cache[(2,)] == {3: 1, 4: 1}
    assert cache[(1, 2)] == {3: 1, 4: 1}
    assert cache[(3, 1)] == {2: 1}
    assert (4,) not in cache and len(cache) == 6


def test_incremental_update_equals_full_update() -> None:
    tokens = [5, 1, 2, 3, 1, 2, 3, 4, 1, 2, 5, 5, 5, 1]
    full: NgramCache = {}
    update_cache(full, tokens, 1, 4)
    incremental: NgramCache = {}
    for end, n_new in ((3, 3), (4, 1), (9, 5), (14, 5)):
        update_cache(incremental, tokens[:end], 1, 4, n_new=n_new)
    assert incremental == full


def test_merge_adds_counts() -> None:
    target: NgramCache = {(1,): {2: 3}, (1, 2): {3: 1}}
    merge_cache(target, {(1,): {2: 2, 4: 1}, (7, 7, 7): {7: 9}})
    assert target == {(1,): {2: 5, 4: 1}, (1, 2): {3: 1}, (7, 7, 7): {7: 9}}


# ---- drafting: thresholds per n-gram size and cache level ----------------------------------------


def test_context_lax_size_1() -> None:
    # sample size 2, 66 %
    assert draft([7], context={(7,): {8: 1}}) == []  # too short an input (< 2 tokens)
    assert draft([6, 7], context={(7,): {8: 1}}) == []  # 1 sample < 2
    assert draft([6, 7], context={(7,): {8: 2}}) == [8]
    assert draft([6, 7], context={(7,): {8: 2, 9: 1}}) == [8]  # 200 >= 66 * 3
    assert draft([6, 7], context={(7,): {8: 1, 9: 1}}) == []  # 50 % < 66 %
    assert draft([6, 7], context={(7,): {8: 3, 9: 2}}) == []  # 60 % < 66 %


def test_context_lax_size_2() -> None:
    # sample size 2, 50 %; the first of equally counted tokens wins
    assert draft([6, 7], context={(6, 7): {8: 1, 9: 1}}) == [8]
    assert draft([6, 7], context={(6, 7): {8: 1}}) == []  # 1 sample < 2
    assert draft([6, 7], context={(6, 7): {8: 1, 9: 1, 10: 1}}) == []  # 33 % < 50 %


def test_context_lax_sizes_3_and_4() -> None:
    # sample size 1, 50 %
    assert draft([5, 6, 7], context={(5, 6, 7): {8: 1}}) == [8]
    assert draft([4, 5, 6, 7], context={(4, 5, 6, 7): {8: 1}}) == [8]
    assert draft([4, 5, 6, 7], context={(4, 5, 6, 7): {8: 1, 9: 2, 10: 2}}) == []  # 40 % < 50 %


def test_longest_ngram_first_then_shorter() -> None:
    context = {(5, 6, 7): {8: 1}, (7,): {9: 5}}
    assert draft([5, 6, 7], n=1, context=context) == [8]
    # the 2-gram fails its sample size, the 1-gram is used
    assert draft([5, 6, 7], n=1, context={(6, 7): {8: 1}, (7,): {9: 2}}) == [9]


def test_dynamic_strict_thresholds() -> None:
    # size 1: sample size 4, 75 %
    assert draft([6, 7], dynamic={(7,): {8: 3}}) == []
    assert draft([6, 7], dynamic={(7,): {8: 4}}) == [8]
    assert draft([6, 7], dynamic={(7,): {8: 3, 9: 1}}) == [8]  # exactly 75 %
    assert draft([6, 7], dynamic={(7,): {8: 5, 9: 2}}) == []  # 71 % < 75 %
    # size 2: sample size 3, 66 %
    assert draft([6, 7], dynamic={(6, 7): {8: 2}}) == []
    assert draft([6, 7], dynamic={(6, 7): {8: 3}}) == [8]
    assert draft([6, 7], dynamic={(6, 7): {8: 2, 9: 1}}) == [8]  # 66.7 %
    # sizes 3 and 4: sample size 2, 66 %
    assert draft([5, 6, 7], dynamic={(5, 6, 7): {8: 1}}) == []
    assert draft([5, 6, 7], dynamic={(5, 6, 7): {8: 2}}) == [8]
    assert draft([4, 5, 6, 7], dynamic={(4, 5, 6, 7): {8: 2, 9: 2}}) == []


def test_context_before_dynamic_before_static() -> None:
    assert draft([6, 7], n=1, context={(7,): {8: 2}}, dynamic={(7,): {9: 10}}, static={(6, 7): {10: 5}}) == [8]
    # context below its thresholds -> dynamic
    assert draft([6, 7], n=1, context={(7,): {8: 1}}, dynamic={(7,): {9: 4}}, static={(6, 7): {10: 5}}) == [9]
    # both below -> static alone
    assert draft([6, 7], n=1, context={(7,): {8: 1}}, dynamic={(7,): {9: 3}}, static={(6, 7): {10: 5}}) == [10]


def test_static_alone_lax_size_2() -> None:
    assert draft([6, 7], static={(6, 7): {8: 2}}) == [8]
    assert draft([6, 7], static={(6, 7): {8: 1}}) == []  # 1 sample < 2
    assert draft([6, 7], static={(6, 7): {8: 1, 9: 1}}) == [8]  # 50 %, first wins
    assert draft([6, 7], static={(6, 7): {8: 1, 9: 1, 10: 1}}) == []
    assert draft([6, 7], static={(7,): {8: 5}}) == []  # only the 2-gram is looked at


def test_static_weighting_changes_the_choice() -> None:
    context = {(5, 6, 7): {8: 2, 9: 2}}
    assert draft([5, 6, 7], n=1, context=context) == [8]
    # 9 is also in the static cache after (6, 7): weight 100 * 1 beats 8's weight 1
    assert draft([5, 6, 7], n=1, context=context, static={(6, 7): {9: 1}}) == [9]
    # both in the static cache: weighted by the static counts
    assert draft([5, 6, 7], n=1, context=context, static={(6, 7): {8: 1, 9: 2}}) == [9]
    assert draft([5, 6, 7], n=1, context=context, static={(6, 7): {8: 3, 9: 2}}) == [8]


def test_static_weighted_choice_must_still_pass_the_percent_check() -> None:
    # 8 holds 75 % of the context samples, but the static cache favours 9, which holds 25 % < 66 %
    context = {(7,): {8: 3, 9: 1}}
    assert draft([6, 7], n=1, context=context) == [8]
    assert draft([6, 7], n=1, context=context, static={(6, 7): {9: 1}}) == []


def test_stops_at_the_first_position_without_a_token() -> None:
    context = {(7,): {8: 2}, (8,): {9: 2}}
    assert draft([6, 7], n=10, context=context) == [8, 9]
    cycle = {(7,): {8: 2}, (8,): {7: 2}}
    assert draft([6, 7], n=5, context=cycle) == [8, 7, 8, 7, 8]


def test_draft_looks_at_drafted_tokens() -> None:
    # the 2-gram (7, 8) only exists once 8 has been drafted
    context = {(6, 7): {8: 1, 5: 1}, (7, 8): {1: 2}}
    assert draft([6, 7], n=3, context=context) == [8, 1]


# ---- file format ------------------------------------------------------------------------------


def test_round_trip(tmp_path: Path) -> None:
    cache: NgramCache = {(1,): {2: 3, 4: 1}, (1, 2): {3: 7}, (1, 2, 3): {0: 1}, (9, 8, 7, 6): {5: 2**31 - 1}}
    path = tmp_path / "c.bin"
    save_cache(cache, path)
    assert path.stat().st_size == 4 * sum(5 + 2 * len(p) for p in cache.values())
    assert load_cache(path) == cache


def test_writes_the_documented_bytes(tmp_path: Path) -> None:
    path = tmp_path / "c.bin"
    save_cache({(11, 12): {13: 4, 14: 1}}, path)
    assert path.read_bytes() == record((11, 12), [(13, 4), (14, 1)])


def test_reads_a_hand_crafted_file(tmp_path: Path) -> None:
    path = tmp_path / "hand.bin"
    path.write_bytes(record((5,), [(6, 2)]) + record((1, 2, 3, 4), [(9, 1), (10, 3)]) + record((100, 200), [(0, 1)]))
    assert load_cache(path) == {(5,): {6: 2}, (1, 2, 3, 4): {9: 1, 10: 3}, (100, 200): {0: 1}}


def test_empty_file_is_an_empty_cache() -> None:
    assert parse_cache(b"") == {}


def test_repeated_records_add_up() -> None:
    data = record((1, 2), [(3, 1)]) + record((1, 2), [(3, 2), (4, 1)])
    assert parse_cache(data) == {(1, 2): {3: 3, 4: 1}}


def test_file_merge_adds_counts(tmp_path: Path) -> None:
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    save_cache({(1, 2): {3: 2}, (5, 5): {5: 1}}, a)
    save_cache({(1, 2): {3: 1, 4: 4}}, b)
    merged = merge_cache(load_cache(a), load_cache(b))
    assert merged == {(1, 2): {3: 3, 4: 4}, (5, 5): {5: 1}}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (record((1, 2), [(3, 1)])[:-2], "not a whole number of int32"),
        (record((1, 2), [(3, 1)]) + struct.pack("<3i", 1, 2, -1), "truncated record header"),
        (record((1, 2), [(3, 1), (4, 1)])[:-8], "truncated record, 2 entries announced but only 1"),
        (struct.pack("<4ii", 1, 2, -1, -1, 0), "number of entries is 0"),
        (struct.pack("<4ii", 1, 2, -1, -1, -5), "number of entries is -5"),
        (struct.pack("<4ii", 1, 2, -1, -1, 2**31 - 1) + struct.pack("<ii", 3, 1), "truncated record"),
        (record((1, 2), [(3, 0)]), "malformed entry"),
        (record((1, 2), [(3, -4)]), "malformed entry"),
        (record((1, 2), [(-3, 1)]), "malformed entry"),
        (struct.pack("<4ii", -1, -1, -1, -1, 1) + struct.pack("<ii", 3, 1), "malformed n-gram"),
        (struct.pack("<4ii", 1, -1, 2, -1, 1) + struct.pack("<ii", 3, 1), "malformed n-gram"),
        (struct.pack("<4ii", 1, -7, -1, -1, 1) + struct.pack("<ii", 3, 1), "malformed n-gram"),
    ],
)
def test_malformed_files_are_refused(tmp_path: Path, data: bytes, message: str) -> None:
    path = tmp_path / "bad.bin"
    path.write_bytes(record((7,), [(8, 1)]) + data)  # a good record first: no silent partial load
    with pytest.raises(SpecserveError, match=message) as info:
        load_cache(path)
    assert str(path) in str(info.value)


def test_missing_and_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(SpecserveError, match="lookup cache not found"):
        load_cache(tmp_path / "nope.bin")
    with pytest.raises(SpecserveError, match="cannot read lookup cache"):
        load_cache(tmp_path)  # a directory


def test_serialize_skips_empty_parts() -> None:
    assert serialize_cache({(1,): {}}) == b""


# ---- the speculator ---------------------------------------------------------------------------


def make(static: str | None = None, dynamic: str | None = None) -> NgramCacheSpeculator:
    params = SpecParams(type="ngram-cache", lookup_cache_static=static, lookup_cache_dynamic=dynamic)
    return NgramCacheSpeculator(params.validate())


def test_name() -> None:
    assert make().name == "ngram_cache"


def test_drafts_from_the_context_of_the_prompt() -> None:
    spec = make()
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    spec.begin(prompt)
    assert spec.draft(prompt, 3, n_max=5) == [4, 1, 2, 3, 4]
    assert spec.draft(prompt, 3, n_max=2) == [4, 1]


def test_context_update_is_incremental(monkeypatch: pytest.MonkeyPatch) -> None:
    fed: list[int] = []
    real_update = nc.update_cache

    def spy(cache: NgramCache, tokens: list[int], lo: int, hi: int, n_new: int | None = None) -> None:
        fed.append(len(tokens) if n_new is None else n_new)
        real_update(cache, tokens, lo, hi, n_new)

    monkeypatch.setattr(nc, "update_cache", spy)
    spec = make()
    sequence = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 6, 1, 2, 3, 4, 1, 2, 3, 4]
    prompt = sequence[:6]
    spec.begin(prompt)
    history = list(prompt)
    for accepted in (0, 2, 1, 0, 3, 0):
        sampled = sequence[len(history)]
        spec.draft(history, sampled, n_max=4)
        history = sequence[:len(history) + 1 + accepted]
    final_sampled = sequence[len(history)]
    spec.draft(history, final_sampled, n_max=4)
    seen = history + [final_sampled]
    assert sum(fed) == len(seen)  # every token counted exactly once, never a rebuild
    expected: NgramCache = {}
    real_update(expected, seen, 1, 4)
    assert spec.context == expected


def test_repeated_call_with_the_same_state_changes_nothing() -> None:
    spec = make()
    spec.begin([1, 2, 1])
    first = spec.draft([1, 2, 1], 2, n_max=4)
    context = {k: dict(v) for k, v in spec.context.items()}
    assert spec.draft([1, 2, 1], 2, n_max=4) == first
    assert spec.context == context


def test_static_file_must_exist(tmp_path: Path) -> None:
    with pytest.raises(SpecserveError, match="static lookup cache not found"):
        make(static=str(tmp_path / "missing.bin"))


def test_static_file_is_used(tmp_path: Path) -> None:
    path = tmp_path / "static.bin"
    save_cache({(6, 7): {8: 3}, (7, 8): {9: 2}}, path)
    spec = make(static=str(path))
    spec.begin([6])
    assert spec.draft([6], 7, n_max=4) == [8, 9]


def test_static_file_is_loaded_once_for_all_slots(tmp_path: Path) -> None:
    """Slots share one read-only copy of a static cache; a rewritten file is loaded again."""
    import os

    path = tmp_path / "static.bin"
    save_cache({(6, 7): {8: 3}}, path)
    a, b = make(static=str(path)), make(static=str(path))
    assert a.static is b.static
    save_cache({(6, 7): {9: 3}, (1, 2): {3: 4}}, path)
    os.utime(path, ns=(1, 1))  # a different stamp even on a coarse clock
    c = make(static=str(path))
    assert c.static is not a.static and c.static[(6, 7)] == {9: 3}


def test_malformed_static_or_dynamic_file_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.bin"
    bad.write_bytes(record((1,), [(2, 1)])[:-4])
    with pytest.raises(SpecserveError, match="truncated"):
        make(static=str(bad))
    with pytest.raises(SpecserveError, match="truncated"):
        make(dynamic=str(bad))


def test_dynamic_file_is_created_loaded_and_merged(tmp_path: Path) -> None:
    path = tmp_path / "dynamic.bin"
    spec = make(dynamic=str(path))
    assert not path.exists() and spec.dynamic == {}
    spec.begin([1, 2, 3])
    assert spec.draft([1, 2, 3], 1, n_max=4) == []  # (1,) -> 2 seen once: below the lax sample size
    spec.end([1, 2, 3])
    first = load_cache(path)
    expected: NgramCache = {}
    update_cache(expected, [1, 2, 3, 1], 1, 4)
    assert first == expected
    spec.end([1, 2, 3])  # nothing new: no double counting
    assert load_cache(path) == expected

    # a new speculator loads it and uses it with the strict thresholds
    save_cache({(6, 7): {8: 4}}, path)
    again = make(dynamic=str(path))
    again.begin([6])
    assert again.draft([6], 7, n_max=4) == [8]
    again.end([6])
    merged = load_cache(path)
    assert merged[(6, 7)] == {8: 4} and merged[(6,)] == {7: 1}


def test_two_speculators_sharing_a_dynamic_file_keep_both_contributions(tmp_path: Path) -> None:
    path = tmp_path / "dynamic.bin"
    a, b = make(dynamic=str(path)), make(dynamic=str(path))
    a.begin([1, 2])
    a.draft([1, 2], 3, n_max=2)
    b.begin([4, 5])
    b.draft([4, 5], 6, n_max=2)
    a.end([1, 2])
    b.end([4, 5])
    cache = load_cache(path)
    assert cache[(1, 2)] == {3: 1} and cache[(4, 5)] == {6: 1}


def test_begin_starts_a_fresh_context() -> None:
    spec = make()
    spec.begin([1, 2, 1, 2])
    spec.draft([1, 2, 1, 2], 1, n_max=4)
    spec.begin([7, 8])
    assert spec.context == {(7,): {8: 1}}
