"""Generated tokens -> text deltas, with stop strings.

A stop string may arrive split over several tokens, so the tail of the text that could
still become a stop string is held back until it either completes one (the text is cut
before it) or can no longer match (it is released).
"""

from __future__ import annotations

from specserve.gguf.tokenizer import IncrementalDecoder, Tokenizer


def partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


class TextStream:
    """Accumulates the text of one generation and hands out the part that is safe to send."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str], keep_special: frozenset[int] = frozenset()):
        # Control tokens are left out of the text, except those in keep_special.
        self._decoder = IncrementalDecoder(tokenizer, skip_special=True, keep=keep_special)
        self.stops = [s for s in stops if s]
        self._max_stop = max((len(s) for s in self.stops), default=0)
        self.text = ""
        self.sent = 0  # characters of text already handed out
        self.stopping_word = ""

    def add(self, token: int) -> bool:
        """Append a token's text; True when a stop string completed (the text now ends before it)."""
        old_len = len(self.text)
        self.text += self._decoder.add(token)
        if not self.stops or len(self.text) == old_len:
            return False
        # A match can only start in the held-back tail, which is shorter than the longest stop.
        start = max(self.sent, old_len - self._max_stop + 1, 0)
        found = -1
        for stop in self.stops:
            pos = self.text.find(stop, start)
            if pos != -1 and (found == -1 or pos < found):
                found, self.stopping_word = pos, stop
        if found == -1:
            return False
        self.text = self.text[:found]
        return True

    def flush(self) -> None:
        """The generation ended without a stop string: complete any partial UTF-8 character."""
        self.text += self._decoder.flush()

    def take(self, final: bool = False) -> str:
        """The text not yet handed out, minus a possible stop-string prefix unless final."""
        end = len(self.text) if final else len(self.text) - partial_stop_len(self.text, self.stops)
        if end <= self.sent:
            return ""
        delta = self.text[self.sent:end]
        self.sent = end
        return delta
