"""Reasoning ("thinking") split from the answer, as llama-server's `--reasoning-format` does.

A reasoning model writes its thoughts in a block that opens its output, `<think>...</think>` (or
`<|begin_of_thought|>...<|end_of_thought|>`, `<thinking>...</thinking>`), then the answer. With format "deepseek"
(and "auto", the same here) the block becomes the message's `reasoning_content` and the rest its `content`; with
"none" everything stays content. Some chat templates open the block in the prompt already: then the output starts
inside it (`started_open`, see `prompt_opens_thinking`) and ends it with any of the closing markers.

Whitespace around the block is dropped (the reasoning is stripped, the answer loses its leading whitespace);
an empty block gives no reasoning (None). A block only counts at the very start of the output: a marker later on
is part of the answer. `split` reads a finished output, `ReasoningStream` one delta at a time, with the same result
however the text is cut.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from specserve.server.held_text import Trimmed, partial_tail

FORMATS = ("none", "deepseek", "auto")
PAIRS = (("<think>", "</think>"), ("<|begin_of_thought|>", "<|end_of_thought|>"), ("<thinking>", "</thinking>"))
OPENERS = tuple(opener for opener, _ in PAIRS)
CLOSERS = tuple(closer for _, closer in PAIRS)

Part = tuple[str, str]  # ("reasoning" | "content", text)


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown reasoning format {fmt!r} (one of {', '.join(FORMATS)})")


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside an opened reasoning block (the template wrote `<think>` for the
    model). Only the prompt's end counts: a marker quoted earlier in the conversation opens nothing."""
    return prompt_text.rstrip().endswith(OPENERS)


def _first(text: str, markers: Iterable[str]) -> tuple[int, str]:
    """Index and text of the earliest marker in `text`; (-1, "") if none."""
    found = [(i, marker) for marker in markers if (i := text.find(marker)) >= 0]
    return min(found) if found else (-1, "")


def _leading_pair(text: str) -> tuple[str, str] | None:
    head = text.lstrip()
    return next((pair for pair in PAIRS if head.startswith(pair[0])), None)


def split(text: str | None, fmt: str = "auto", started_open: bool = False) -> tuple[str | None, str]:
    """(reasoning_content, content) of a finished output."""
    _check_format(fmt)
    text = text or ""
    if fmt == "none":
        return None, text
    pair = _leading_pair(text)
    closers: tuple[str, ...]
    if pair is not None:  # (a model may write the opener again after the prompt opened the block)
        body, closers = text.lstrip()[len(pair[0]):], (pair[1],)
    elif started_open:
        body, closers = text, CLOSERS
    else:
        return None, text
    end, closer = _first(body, closers)
    if end < 0:  # still thinking when the output stopped
        return body.strip() or None, ""
    return body[:end].strip() or None, body[end + len(closer):].lstrip()




class ReasoningStream:
    """`split` one delta at a time: `feed` and `finish` give ("reasoning" | "content", text) parts, each as soon
    as it is certain. Held back: the start of the output while it may still become an opener, an end that may
    begin a closer, and reasoning's trailing whitespace (dropped if the block ends after it)."""

    def __init__(self, fmt: str = "auto", started_open: bool = False):
        _check_format(fmt)
        self._state = "content" if fmt == "none" else "open" if started_open else "start"
        self._closers = CLOSERS
        self._buf = ""
        self._reasoning_text = Trimmed(lead=True)  # the reasoning is stripped
        self._handlers: dict[str, Callable[[bool], list[Part]]] = {
            "start": self._start, "open": self._open, "reasoning": self._reasoning, "after": self._after,
            "content": self._content}

    def feed(self, delta: str) -> list[Part]:
        self._buf += delta
        return self._drain(final=False)

    def finish(self) -> list[Part]:
        """The output ended: what is held is decided now (an unclosed block's reasoning ends here)."""
        parts = self._drain(final=True)
        self._reasoning_text.boundary()
        return parts

    def _drain(self, final: bool) -> list[Part]:
        parts: list[Part] = []
        while True:
            before = (self._state, len(self._buf))
            parts += self._handlers[self._state](final)
            if (self._state, len(self._buf)) == before:
                return parts

    def _opener(self, final: bool) -> tuple[bool, tuple[str, str] | None]:
        """(known, pair): whether the buffer (after whitespace) starts with an opener; not known while it is
        whitespace or the beginning of one."""
        pair = _leading_pair(self._buf)
        if pair is not None:
            return True, pair
        head = self._buf.lstrip()
        if not final and (not head or any(opener.startswith(head) for opener in OPENERS)):
            return False, None
        return True, None

    def _enter(self, pair: tuple[str, str]) -> None:
        self._buf = self._buf.lstrip()[len(pair[0]):]
        self._closers = (pair[1],)
        self._state = "reasoning"

    def _start(self, final: bool) -> list[Part]:
        return self._at_opener(final, "content")

    def _open(self, final: bool) -> list[Part]:
        return self._at_opener(final, "reasoning")

    def _at_opener(self, final: bool, without: str) -> list[Part]:
        """An opener (once known) enters its block; with none the output goes on in state `without`."""
        known, pair = self._opener(final)
        if known:
            if pair is None:
                self._state = without
            else:
                self._enter(pair)
        return []

    def _reasoning(self, final: bool) -> list[Part]:
        end, closer = _first(self._buf, self._closers)
        if end >= 0:
            parts = self._think(self._buf[:end])
            self._buf = self._buf[end + len(closer):]
            self._reasoning_text.boundary()
            self._state = "after"
            return parts
        cut = len(self._buf) - (0 if final else partial_tail(self._buf, self._closers))
        parts = self._think(self._buf[:cut])
        self._buf = self._buf[cut:]
        return parts

    def _think(self, text: str) -> list[Part]:
        body = self._reasoning_text.add(text)
        return [("reasoning", body)] if body else []

    def _after(self, final: bool) -> list[Part]:
        text = self._buf.lstrip()
        if text:
            self._state = "content"
        self._buf = text
        return []

    def _content(self, final: bool) -> list[Part]:
        text, self._buf = self._buf, ""
        return [("content", text)] if text else []
