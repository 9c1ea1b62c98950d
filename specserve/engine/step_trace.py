"""An optional timeline of the scheduler's steps, for finding where a step's time goes: set
SPECSERVE_STEP_TRACE=<file> and each launched step records when the host began planning it, called and
returned from the runner's launch, began waiting for its result and had it, and (a step graph) its device
time and the device's idle time before it, from events around the replay; the list is written as JSON at
exit. `benchmarks/step_trace.py` summarises it. Off (None) unless the variable is set.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from typing import Any

import torch


class StepTrace:
    def __init__(self, path: str):
        self.path = path
        self.steps: list[dict[str, Any]] = []
        self._events: list[tuple[Any, Any]] = []
        self._lock = threading.Lock()
        self._planning = 0.0
        self._replay: tuple[Any, Any] | None = None
        atexit.register(self.dump)

    @classmethod
    def from_env(cls) -> StepTrace | None:
        path = os.environ.get("SPECSERVE_STEP_TRACE")
        return cls(path) if path else None

    def planning(self) -> None:
        """The host starts planning the next step."""
        self._planning = time.perf_counter()

    def launching(self) -> float:
        self._replay = None
        return time.perf_counter()

    def replay(self, graph: torch.cuda.CUDAGraph) -> None:
        """A step graph's replay between two timing events (its device time, apart from the host's launch)."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        self._replay = (start, end)

    def launched(self, t0: float, rows: int, drafted: bool, prompt: bool) -> int:
        """Record a launched step (its graph's events, if it replayed one); returns its index (for mark)."""
        start, end = self._replay or (None, None)
        with self._lock:
            self.steps.append({"plan": self._planning, "launch": t0, "launched": time.perf_counter(), "rows": rows,
                               "drafted": drafted, "prompt": prompt})
            self._events.append((start, end))
            return len(self.steps) - 1

    def clear(self) -> None:
        """Forget the steps recorded so far (a new measurement in the same process)."""
        with self._lock:
            self.steps.clear()
            self._events.clear()

    def mark(self, index: int, name: str) -> None:
        if index >= 0:
            self.steps[index][name] = time.perf_counter()

    def dump(self) -> None:
        """Write the steps (none recorded, nothing written: `specserve serve`'s front process has the variable too,
        and exits after the engine core wrote its steps)."""
        with self._lock:
            steps, events = list(self.steps), list(self._events)
        if not steps:
            return
        if any(e[1] is not None for e in events):
            torch.cuda.synchronize()
        for i, (step, (start, end)) in enumerate(zip(steps, events, strict=True)):
            if start is None:
                continue
            step["device_ms"] = start.elapsed_time(end)
            if i > 0 and events[i - 1][1] is not None:
                step["idle_before_ms"] = max(events[i - 1][1].elapsed_time(start), 0.0)
        with open(self.path, "w") as f:
            json.dump({"steps": steps}, f)


TRACE = StepTrace.from_env()
