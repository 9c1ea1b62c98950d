"""Reasoning split from content (server/reasoning.py): whole outputs, streams, and the prompt check."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.server.reasoning import ReasoningStream, prompt_opens_thinking, split


@pytest.mark.parametrize(("text", "started_open", "expected"), [
    ("<think>\nLet me see.\n</think>\n\nParis.", False, ("Let me see.", "Paris.")),
    ("\n<think>a</think>b", False, ("a", "b")),
    ("<|begin_of_thought|>x<|end_of_thought|>y", False, ("x", "y")),
    ("<thinking> x </thinking>  y ", False, ("x", "y ")),
    ("Paris.", False, (None, "Paris.")),
    ("  Paris.\n", False, (None, "  Paris.\n")),
    ("Answer: <think>no</think>", False, (None, "Answer: <think>no</think>")),  # only at the start
    ("<think>\n\n</think>\n\nHi", False, (None, "Hi")),  # an empty block gives no reasoning
    ("<think>still going", False, ("still going", "")),
    ("<think>a</thinking>b", False, ("a</thinking>b", "")),  # only the opener's own closer ends it
    ("I wonder.\n</think>\n\nParis.", True, ("I wonder.", "Paris.")),
    ("<think>I wonder.</think>Paris.", True, ("I wonder.", "Paris.")),  # the opener written again
    ("I wonder.<|end_of_thought|>Paris.", True, ("I wonder.", "Paris.")),
    ("no end", True, ("no end", "")),
    ("", True, (None, "")),
    ("", False, (None, "")),
])
def test_split(text: str, started_open: bool, expected: tuple[str | None, str]) -> None:
    assert split(text, "deepseek", started_open) == expected
    assert split(text, "auto", started_open) == expected


def test_split_none_keeps_everything() -> None:
    assert split("<think>a</think>b", "none") == (None, "<think>a</think>b")
    assert split("a</think>b", "none", started_open=True) == (None, "a</think>b")
    assert split(None) == (None, "")


def test_unknown_format() -> None:
    with pytest.raises(ValueError, match="reasoning format"):
        split("x", "r1")
    with pytest.raises(ValueError, match="reasoning format"):
        ReasoningStream("r1")


def test_prompt_opens_thinking() -> None:
    assert prompt_opens_thinking("<|User|>hi<|Assistant|><think>\n")
    assert prompt_opens_thinking("...assistant\n<|begin_of_thought|>")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")
    assert not prompt_opens_thinking("Use <think> tags.<|im_start|>assistant\n")


def _joined(parts: list[tuple[str, str]]) -> tuple[str | None, str]:
    reasoning = "".join(text for kind, text in parts if kind == "reasoning")
    return reasoning or None, "".join(text for kind, text in parts if kind == "content")


def test_stream_emits_early() -> None:
    stream = ReasoningStream("deepseek")
    assert stream.feed("<thi") == []  # may become an opener
    assert stream.feed("nk>\nStep one.") == [("reasoning", "Step one.")]
    assert stream.feed(" Two.\n</th") == [("reasoning", " Two.")]  # whitespace and a partial closer held
    assert stream.feed("ink>\n\nThe answer") == [("content", "The answer")]
    assert stream.feed(" is 4.") == [("content", " is 4.")]
    assert stream.finish() == []


def test_stream_plain_text_is_not_held() -> None:
    stream = ReasoningStream("auto")
    assert stream.feed("Hello") == [("content", "Hello")]
    assert stream.feed(" <think>") == [("content", " <think>")]


FRAGMENTS = ["<think>", "</think>", "<thinking>", "</thinking>", "<|begin_of_thought|>", "<|end_of_thought|>",
             "<th", "</", "<|", "ink>", " ", "\n", "a", "bc", "<", ">"]


def _streamed(deltas: list[str], fmt: str, started_open: bool) -> tuple[str | None, str]:
    stream = ReasoningStream(fmt, started_open)
    parts = [part for delta in deltas for part in stream.feed(delta)] + stream.finish()
    assert all(text for _, text in parts)
    return _joined(parts)


@settings(max_examples=400, deadline=None)
@given(data=st.data(), fmt=st.sampled_from(["none", "deepseek", "auto"]), started_open=st.booleans())
def test_stream_matches_split(data: st.DataObject, fmt: str, started_open: bool) -> None:
    text = "".join(data.draw(st.lists(st.sampled_from(FRAGMENTS), max_size=12)))
    bounds = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=8))))
    deltas = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]
    expected = split(text, fmt, started_open)
    assert _streamed(deltas, fmt, started_open) == expected
    assert _streamed(list(text), fmt, started_open) == expected  # one character at a time
