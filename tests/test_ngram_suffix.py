"""ngram-suffix drafting rules and its index, checked against a plain scan of the history."""

from __future__ import annotations

import random

from specserve.speculative.base import SELECTABLE_TYPES, SpecParams
from specserve.speculative.factory import build_chain
from specserve.speculative.ngram_suffix import DRAFT_BEYOND_MATCH, LONGEST, NgramSuffix, SuffixIndex


def make(n: int = 12, m: int = 48) -> NgramSuffix:
    return NgramSuffix(SpecParams(type="ngram-suffix", ngram_size_n=n, ngram_size_m=m).validate())


def scan_longest(history: list[int], last: int, longest: int) -> tuple[int, int] | None:
    """The reference: every earlier occurrence of `last`, extended backwards; the longest (capped at
    `longest`), the latest among equals."""
    seq = history + [last]
    best: tuple[int, int] | None = None
    for end in range(len(history) - 1, -1, -1):
        k = 0
        while k < longest and end - k >= 0 and seq[end - k] == seq[len(seq) - 1 - k]:
            k += 1
        if k and (best is None or k > best[0]):
            best = (k, end)
    return best


def test_selectable_and_built_by_the_factory() -> None:
    assert "ngram-suffix" in SELECTABLE_TYPES
    chain = build_chain(SpecParams(type="ngram-suffix"))
    assert chain is not None and [m.name for m in chain.members] == ["ngram_suffix"]


def test_longest_match_wins_over_the_latest() -> None:
    # "1 2" last occurred at 7-8 (followed by 9), but "0 1 2" occurred at 0-2, followed by 3 4 5.
    history = [0, 1, 2, 3, 4, 5, 6, 1, 2, 9, 9, 8, 8, 0, 1]
    assert make().draft(history, 2, n_max=16) == [3, 4, 5, 6, 1, 2]  # k = 3 -> 3 + 3 tokens


def test_latest_occurrence_among_equally_long_matches() -> None:
    history = [7, 1, 2, 3, 8, 1, 4, 5, 9]
    assert make().draft(history, 1, n_max=16) == [4, 5, 9, 1]  # k = 1: 1 + 3 tokens, ending at `last`


def test_draft_length_follows_the_match_length() -> None:
    body = list(range(100, 130))
    history = body + [0] + body[:10]
    draft = make().draft(history, body[10], n_max=64)
    assert draft == body[11:11 + 11 + DRAFT_BEYOND_MATCH]  # matched 11 tokens
    assert make(n=4).draft(history, body[10], n_max=64) == body[11:11 + 4 + DRAFT_BEYOND_MATCH]
    assert make(m=5).draft(history, body[10], n_max=64) == body[11:16]
    assert make().draft(history, body[10], n_max=2) == body[11:13]
    long_body = list(range(100, 200))
    long_history = long_body + [0] + long_body[:60]
    draft = make(n=1024, m=1024).draft(long_history, long_body[60], n_max=1024)
    assert draft == long_body[61:61 + LONGEST + DRAFT_BEYOND_MATCH]  # n is capped at LONGEST


def test_unseen_token_gives_no_draft() -> None:
    spec = make()
    assert spec.draft([1, 2, 3], 4, n_max=16) == []
    assert spec.draft([], 4, n_max=16) == []
    assert spec.stats.calls == 2 and spec.stats.gen_drafts == 0


def test_match_just_before_the_last_token_drafts_it() -> None:
    assert make().draft([5, 5, 5], 5, n_max=16) == [5]


def test_index_matches_a_scan_as_the_history_grows_and_is_replaced() -> None:
    rng = random.Random(11)
    for longest in (1, 3, 12):
        index = SuffixIndex(longest)
        history: list[int] = []
        for step in range(300):
            if step == 150:
                history = history[:40]  # another history: shorter, then growing again
            index.update(history)
            last = rng.randrange(5)
            assert index.longest_match(history, last) == scan_longest(history, last, longest)
            history.append(rng.randrange(5))


def test_drafts_agree_with_a_scan_on_text_with_repeats() -> None:
    rng = random.Random(3)
    words = [rng.randrange(50) for _ in range(40)]
    history = words + [rng.randrange(50) for _ in range(5)] + words[:20]
    spec = make()
    for cut in range(45, len(history)):
        match = scan_longest(history[:cut], history[cut], 12)
        expected = [] if match is None else (history[:cut] + [history[cut]])[match[1] + 1:][:min(16, match[0] + 3)]
        assert spec.draft(history[:cut], history[cut], n_max=16) == expected


def test_positions_past_the_index_are_matched_as_if_indexed() -> None:
    """A draft compares the positions the index has not taken yet (prepare() indexes them while the
    device works) directly: same matches as a full index, ties going to the later position."""
    rng = random.Random(5)
    for longest in (1, 4, 12):
        for _ in range(200):
            history = [rng.randrange(4) for _ in range(rng.randrange(1, 60))]
            index = SuffixIndex(longest)
            index.update(history[:len(history) - rng.randrange(0, min(16, len(history)) + 1)])
            last = rng.randrange(4)
            assert index.longest_match(history, last) == scan_longest(history, last, longest)


def test_drafts_do_not_depend_on_prepare() -> None:
    rng = random.Random(9)
    text = [rng.randrange(30) for _ in range(400)]
    text[200:260] = text[20:80]  # a long copy
    prepared, lazy = make(), make()
    long_drafts = 0
    for cut in range(100, len(text) - 1):
        if cut % 3:
            prepared.prepare(text[:cut])
        draft = prepared.draft(text[:cut], text[cut], n_max=16)
        assert draft == lazy.draft(text[:cut], text[cut], n_max=16)
        long_drafts += len(draft) > 8
    assert long_drafts > 20  # the copy was found


def test_another_history_is_not_matched_against_the_old_index() -> None:
    index = SuffixIndex(12)
    index.update([1, 2, 3, 4, 5, 6, 7, 8])
    other = [9, 2, 3]  # not a continuation of the indexed history: its old ends must not be trusted
    assert index.longest_match(other, 9) == scan_longest(other, 9, 12) == (1, 0)
    assert index.longest_match(other, 4) is None  # "2 3 4" ended at 3 in the old history only
