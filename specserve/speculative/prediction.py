"""Predicted outputs: a request's own guess at its answer (OpenAI's `prediction`, e.g. the file being edited) as
a draft source.

An edit keeps most of the file: the answer follows the prediction, departs from it where the edit is, and
rejoins it after. The drafter keeps an anchor, the position in the prediction just after the text generated so
far. While the answer follows the prediction the anchor moves with it and each draft is the prediction's next
tokens. After a departure the anchor is found again from the answer's last tokens: the longest tail (up to
`MAX_KEY` tokens) that occurs in the prediction, preferring the first occurrence at or after the old anchor (an
edit moves forward through the file). So an edit costs the few steps its new text needs, not the rest of the
file.
"""

from __future__ import annotations

from collections import defaultdict

from specserve.speculative.base import Speculator

MAX_KEY = 8  # the longest answer tail looked up in the prediction
MIN_BACKWARD_KEY = 4  # a tail must be this long to anchor before the current anchor (text repeated earlier)


class PredictionDrafter(Speculator):
    name = "prediction"

    def __init__(self, prediction: list[int]):
        super().__init__()
        self.prediction = list(prediction)
        self.anchor = 0  # prediction[anchor] is the token expected after the text so far
        self._where: dict[tuple[int, ...], list[int]] = defaultdict(list)  # key -> prediction positions after it
        for k in range(1, MAX_KEY + 1):
            for end in range(k, len(self.prediction) + 1):
                self._where[tuple(self.prediction[end - k:end])].append(end)

    def _propose(self, history: list[int], last_sampled: int, n_max: int) -> list[int]:
        p = self.prediction
        start: int | None
        if 0 < self.anchor <= len(p) and p[self.anchor - 1] == last_sampled and self._follows(history):
            start = self.anchor  # still on the prediction
        else:
            start = self._find(history, last_sampled)
        if start is None:
            return []
        self.anchor = start
        return p[start:start + n_max]

    def _follows(self, history: list[int]) -> bool:
        """The token before last_sampled is the prediction's too (else last_sampled only happens to match)."""
        return self.anchor < 2 or (bool(history) and history[-1] == self.prediction[self.anchor - 2])

    def _find(self, history: list[int], last_sampled: int) -> int | None:
        """Where the answer's tail ends in the prediction: the longest tail with an occurrence, the first one at or
        after the anchor (or, for a long tail, anywhere)."""
        tail = [*history[-(MAX_KEY - 1):], last_sampled]
        for k in range(len(tail), 0, -1):
            ends = self._where.get(tuple(tail[-k:]))
            if not ends:
                continue
            ahead = next((e for e in ends if e >= self.anchor), None)
            if ahead is not None:
                return ahead
            if k >= MIN_BACKWARD_KEY:
                return ends[0]
        return None

    def _accepted(self, n_accepted: int) -> None:
        # The next draft starts after the accepted tokens and the one the target sampled itself: _propose then
        # checks that sample against the prediction before trusting the anchor.
        self.anchor += n_accepted + 1
