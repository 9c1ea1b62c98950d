"""What a streamed answer's readers hold back until later text decides it: an end that may begin a marker, and
whitespace next to a boundary. The tool-call scanners (tool_scanners.py, tool_calls.py) and the reasoning splitter
(reasoning.py) both hold text back this way."""

from __future__ import annotations

from collections.abc import Iterable


def partial_tail(buf: str, markers: Iterable[str]) -> int:
    """Length of the longest end of `buf` that is a proper beginning of a marker (held back while streaming)."""
    best = 0
    for marker in markers:
        for size in range(min(len(buf), len(marker) - 1), best, -1):
            if buf.endswith(marker[:size]):
                best = size
                break
    return best


class Trimmed:
    """Streamed text with the whitespace at its edges dropped: leading whitespace while `lead` (set again after a
    boundary, e.g. a call), and trailing whitespace held back until text follows it (`held`), since a boundary may
    come next. The tool-call stream trims content with it, the reasoning splitter its reasoning."""

    def __init__(self, lead: bool):
        self.lead = lead
        self.held = ""

    def boundary(self) -> None:
        """A boundary (a call, the block's end): the whitespace held before it is dropped, and leading whitespace
        after it too."""
        self.held = ""
        self.lead = True

    def add(self, text: str) -> str:
        """What of `text` can go out now."""
        if self.lead:
            text = text.lstrip()
            if not text:
                return ""
            self.lead = False
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body):]
        return body
