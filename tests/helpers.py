"""Small helpers several tests share."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from specserve.engine.sampling import SamplingParams
from specserve.engine.scheduler import Scheduler
from specserve.engine.tasks import Chunk, Failure, Result, Task, TaskHandle
from specserve.gguf.tokenizer import Tokenizer
from specserve.model.batch import Batch
from specserve.speculative.base import SpecParams
from specserve.speculative.factory import build_chain

GREEDY = SamplingParams(temperature=0.0)


def prefill(runner, seq: int, tokens: list[int], n_batch: int = 512, start: int = 0) -> torch.Tensor:
    """Evaluate tokens[start:] of sequence seq in chunks of n_batch; the logits of the last token."""
    logits = None
    for chunk_start in range(start, len(tokens), n_batch):
        batch = Batch()
        batch.add_sequence(tokens[chunk_start:chunk_start + n_batch], chunk_start, seq, "last")
        logits = runner.forward(batch)[0]
    assert logits is not None
    return logits


@contextmanager
def running_scheduler(runner, tokenizer: Tokenizer, n_batch: int = 16) -> Iterator[Scheduler]:
    """A started scheduler with the draft-free speculators, drafting whenever they can (tests assert drafts
    were made); small n_batch: prompts are read in chunks."""
    sched = Scheduler(runner, tokenizer, n_batch=n_batch, chain_factory=lambda s, slot: build_chain(s, None, seq=slot),
                      adaptive_drafts=False)
    sched.start()
    try:
        yield sched
    finally:
        sched.shutdown()


def submit(sched: Scheduler, tokenizer: Tokenizer, prompt: str, n_predict: int = 12,
           spec: SpecParams | None = None, **kw: object) -> tuple[TaskHandle, queue.Queue]:
    events: queue.Queue = queue.Queue()
    task = Task(tokenizer.encode(prompt), GREEDY, spec or SpecParams(), n_predict=n_predict, **kw)  # type: ignore[arg-type]
    return sched.submit(task, events.put), events


def wait(events: queue.Queue) -> tuple[str, Result | Failure]:
    text = ""
    while True:
        event = events.get(timeout=120)
        if isinstance(event, Chunk):
            text += event.text
        else:
            return text, event
