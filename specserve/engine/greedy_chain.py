"""Plain greedy decoding with the host a step ahead of the device.

Each step evaluates one token and takes the argmax of its logits on the device, where the
next step reads its token (LocalRunner.greedy_step). So step i + 1 is queued before the host
has seen token i: the GPU runs the steps back to back, and the host's per-token work
(detokenizing, stop checks, streaming) overlaps them instead of adding to every step. A step
queued past the end (the previous token ended generation) only writes a KV entry past what
the caller keeps.
"""

from __future__ import annotations

from collections import deque

from specserve.engine.host_copy import HostCopies
from specserve.engine.runner import LocalRunner

DEPTH = 2  # steps in flight: one running, one queued behind it


class GreedyChain:
    """Queues greedy steps of one sequence, starting with `token` at `position`."""

    def __init__(self, runner: LocalRunner, seq: int, token: int, position: int):
        self.runner = runner
        self.seq = seq
        self._step = runner.greedy_step()
        self._copies = HostCopies(runner.device, DEPTH, 1)
        self._queued: deque[int] = deque()  # host slots of queued steps, oldest first
        self._n_submitted = 0
        self.restart(token, position)

    def restart(self, token: int, position: int) -> None:
        """Continue from `token` at `position` (at the start, and after steps that ran outside the chain):
        the next step evaluates it, uploaded by that step's graph."""
        assert not self._queued, "restart with steps in flight"
        self._start: int | None = token
        self.position = position  # where the next queued step writes

    @property
    def in_flight(self) -> int:
        return len(self._queued)

    def submit(self) -> None:
        """Queue the next step (at most DEPTH in flight)."""
        assert self.in_flight < DEPTH
        slot = self._n_submitted % DEPTH
        self._copies.start(slot, self._step(self.seq, self.position, self._start))
        self._start = None
        self._queued.append(slot)
        self._n_submitted += 1
        self.position += 1

    def next_token(self) -> int:
        """The token picked by the oldest queued step (waits for that step only)."""
        return self._copies.read(self._queued.popleft(), 1)[0]

    def close(self, n_keep: int) -> None:
        """Wait for queued steps and keep the sequence's first n_keep KV entries."""
        for slot in self._queued:
            self._copies.wait(slot)
        self._queued.clear()
        self.runner.kv_truncate(self.seq, n_keep)
