"""The lookup tools: static cache building, merging, lookup stats, and the `lookup` CLI."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from specserve.cli import lookup as lookup_cli
from specserve.errors import SpecserveError
from specserve.speculative.lookup import build_static_cache, lookup_stats, merge_cache_files
from specserve.speculative.ngram_cache import NgramCache, load_cache, save_cache


def test_static_cache_holds_2_grams_only() -> None:
    cache = build_static_cache([1, 2, 3, 1, 2, 4])
    assert cache == {(1, 2): {3: 1, 4: 1}, (2, 3): {1: 1}, (3, 1): {2: 1}}


def test_merge_cache_files(tmp_path: Path) -> None:
    paths = [tmp_path / "a.bin", tmp_path / "b.bin", tmp_path / "c.bin"]
    save_cache({(1, 2): {3: 1}}, paths[0])
    save_cache({(1, 2): {3: 2, 5: 1}}, paths[1])
    save_cache({(4,): {4: 4}}, paths[2])
    assert merge_cache_files(paths) == {(1, 2): {3: 3, 5: 1}, (4,): {4: 4}}
    with pytest.raises(SpecserveError, match="not found"):
        merge_cache_files([paths[0], tmp_path / "missing.bin"])


def test_stats_context_only() -> None:
    # [1] and [1, 2] and [1, 2, 3] and [1, 2, 3, 1] and [1, 2, 3, 1, 2] give no draft (too few
    # samples); at [1, 2, 3, 1, 2, 3] the 3- and 4-grams draft [1, 2, 3]: all correct
    stats = lookup_stats([1, 2, 3] * 3, n_draft=3, n_ctx=100)
    assert (stats.n_predict, stats.n_drafted, stats.n_accept) == (9, 3, 3)
    assert stats.accept_rate == 1.0


def test_stats_stop_at_the_first_wrong_token() -> None:
    stats = lookup_stats([1, 2, 3, 1, 2, 3, 1, 2, 4], n_draft=3, n_ctx=100)
    assert (stats.n_drafted, stats.n_accept) == (3, 2)
    assert "accept    = 66.667%" in stats.lines()


def test_stats_with_a_static_cache() -> None:
    tokens = [1, 2, 3] * 3
    static = build_static_cache(tokens)
    # at [1, 2] the static cache drafts 3, 1, 2 (all right); at [1, 2, 3, 1, 2, 3] the context 1, 2, 3
    stats = lookup_stats(tokens, n_draft=3, n_ctx=100, static=static)
    assert (stats.n_drafted, stats.n_accept) == (6, 6)


def test_stats_chunks_feed_the_dynamic_cache() -> None:
    dynamic: NgramCache = {}
    stats = lookup_stats([1, 2, 3] * 3, n_draft=4, n_ctx=3, dynamic=dynamic)
    # each chunk [1, 2, 3] starts with an empty context; the dynamic cache never has 3 samples in time
    assert (stats.n_predict, stats.n_drafted, stats.n_accept) == (9, 0, 0)
    assert dynamic == {(1,): {2: 3}, (2,): {3: 3}, (1, 2): {3: 3}}
    # with that history, the strict dynamic thresholds (2-gram: 3 samples) now draft the 3
    again = lookup_stats([1, 2, 3] * 3, n_draft=4, n_ctx=3, dynamic=dynamic)
    assert (again.n_drafted, again.n_accept) == (3, 3)


def test_stats_last_partial_chunk() -> None:
    assert lookup_stats([1, 2, 3, 1, 2, 3, 1], n_draft=2, n_ctx=3).n_predict == 6  # 1 token: nothing to replay
    assert lookup_stats([1, 2, 3, 1, 2], n_draft=2, n_ctx=3).n_predict == 5


def test_stats_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        lookup_stats([1, 2], n_draft=0, n_ctx=10)
    with pytest.raises(ValueError):
        lookup_stats([1, 2], n_draft=1, n_ctx=1)


# ---- CLI ----------------------------------------------------------------------------------------


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="specserve")
    lookup_cli.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_cli_merge(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b, out = tmp_path / "a.bin", tmp_path / "b.bin", tmp_path / "out.bin"
    save_cache({(1, 2): {3: 1}}, a)
    save_cache({(1, 2): {3: 2}, (7, 8): {9: 1}}, b)
    args = parse(["lookup", "merge", str(a), str(b), "-o", str(out)])
    assert args.func(args) == 0
    assert load_cache(out) == {(1, 2): {3: 3}, (7, 8): {9: 1}}
    assert "2 n-grams, 2 entries from 2 files" in capsys.readouterr().out


def test_cli_errors(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("hello")
    args = parse(["lookup", "stats", "-f", str(text), "-lcs", str(tmp_path / "none.bin")])
    with pytest.raises(SpecserveError, match="static lookup cache not found"):
        args.func(args)
    args = parse(["lookup", "create", "-f", str(tmp_path / "none.txt"), "-o", str(tmp_path / "o.bin")])
    with pytest.raises(SpecserveError, match="text file not found"):
        args.func(args)
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\x01\x00\x00")
    args = parse(["lookup", "merge", str(bad), "-o", str(tmp_path / "o.bin")])
    with pytest.raises(SpecserveError, match="truncated"):
        args.func(args)
    for argv in (["lookup"], ["lookup", "stats", "-f", "x", "--draft-max", "0"], ["lookup", "merge", "-o", "x"]):
        with pytest.raises(SystemExit):
            parse(argv)


def test_cli_create_and_stats_with_the_default_model(smollm_path: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("def add(a, b):\n    return a + b\n\n" * 20, encoding="utf-8")
    static = tmp_path / "static.bin"
    args = parse(["lookup", "create", "-f", str(text), "-o", str(static)])
    assert args.func(args) == 0
    cache = load_cache(static)
    assert cache and all(len(ngram) == 2 for ngram in cache)

    args = parse(["lookup", "stats", "-f", str(text), "-lcs", str(static), "--draft-max", "8"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    values = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    n_drafted, n_accept = int(values["n_drafted "]), int(values["n_accept  "])
    assert int(values["n_draft   "]) == 8
    assert n_accept > 0 and n_drafted >= n_accept  # a 20x repeated text is mostly predictable
