"""Generation from the caller's thread: a request run through the scheduler, the same decode loop the
server runs, driven by `Scheduler.run_once()` instead of the scheduler's own thread. What
`specserve generate`, `specserve bench` and the benchmark scripts use.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from specserve.engine.runner import Runner
from specserve.engine.sampling import SamplingParams
from specserve.engine.scheduler import ChainFactory, Scheduler
from specserve.engine.tasks import Chunk, Event, Failure, Progress, Result, Task
from specserve.errors import SpecserveError
from specserve.gguf.tokenizer import Tokenizer
from specserve.speculative.base import SpecParams


def run_task(scheduler: Scheduler, task: Task) -> Iterator[Chunk | Result]:
    """Submit the task and turn the scheduler until it ends: its Chunks, then its Result. A failure raises
    SpecserveError; leaving the loop early cancels the task (its slot is free on return)."""
    events: deque[Event] = deque()
    handle = scheduler.submit(task, events.append)
    try:
        while True:
            if not events:
                if not scheduler.busy:
                    raise SpecserveError("the scheduler stopped before the task ended")
                scheduler.run_once()
            while events:
                event = events.popleft()
                if isinstance(event, Failure):
                    raise SpecserveError(event.message)
                if isinstance(event, Progress):
                    continue
                yield event
                if isinstance(event, Result):
                    return
    finally:
        if not handle.done:
            handle.cancel()
            while not handle.done and scheduler.busy:
                scheduler.run_once()


@dataclass
class Generation:
    """What one generate() call produced."""

    tokens: list[int]
    text: str
    result: Result

    @property
    def decode_rate(self) -> float:
        """Generated tokens/s after the first (which the prompt's forward pass gives)."""
        ms = self.result.predicted_ms
        return (self.result.n_predicted - 1) * 1000.0 / ms if ms > 0 else 0.0


def generate(runner: Runner, tokenizer: Tokenizer, prompt: list[int], n_predict: int,
             sampling: SamplingParams | None = None, spec: SpecParams | None = None, *,
             chain_factory: ChainFactory | None = None, overlap: bool = True, ignore_eos: bool = False,
             scheduler: Scheduler | None = None) -> Generation:
    """Generate up to n_predict tokens after prompt (an end-of-generation token ends it, included). A
    scheduler given is reused (its slots keep their caches and speculators); otherwise one is made."""
    scheduler = scheduler or Scheduler(runner, tokenizer, chain_factory=chain_factory, overlap=overlap)
    task = Task(prompt=list(prompt), sampling=sampling or SamplingParams(temperature=0),
                spec=spec or SpecParams(n_max=0), n_predict=n_predict, ignore_eos=ignore_eos)
    tokens: list[int] = []
    text: list[str] = []
    for event in run_task(scheduler, task):
        if isinstance(event, Chunk):
            tokens.extend(event.tokens)
            text.append(event.text)
        else:
            return Generation(tokens, "".join(text), event)
    raise AssertionError("run_task ends with a Result")
