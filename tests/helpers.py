"""Small helpers several tests share."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from specserve.engine.sampling import SamplingParams
from specserve.engine.scheduler import Scheduler
from specserve.engine.tasks import Chunk, Failure, Result, Task, TaskHandle
from specserve.gguf.tokenizer import Tokenizer
from specserve.model.batch import Batch
from specserve.model.token_tree import TokenTree
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


def ancestors(tree: TokenTree, i: int) -> set[int]:
    """Node i and the nodes above it."""
    out = {i}
    while tree.parents[i] >= 0:
        i = tree.parents[i]
        out.add(i)
    return out


def check_tree_step(runner, prompt: list[int], tokens: list[int],
                    same: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
    """A tree step of sequence 0 after `prompt` (three candidates over five tokens a..e) gives each node the
    logits of its path decoded as a plain draft, and after kv_compact of the third candidate's branch the next
    step continues as if only that path had been decoded; `same` says how close is equal on this runner."""
    a, b, c, d, e = tokens
    tree = TokenTree.merge(a, [[b, c], [b, d], [e, c, d]])
    start = len(prompt)
    runner.kv_truncate(0, 0)
    prefill(runner, 0, prompt)
    batch = Batch()
    batch.add_tree(tree, start, 0)
    got = runner.forward(batch).clone()

    def alone(path_tokens: list[int]) -> torch.Tensor:
        runner.kv_truncate(0, start)
        chain = Batch()
        chain.add_sequence(path_tokens, start, 0, "all")
        return runner.forward(chain)[-1].clone()

    paths = [sorted(ancestors(tree, i)) for i in range(len(tree))]
    for i, path in enumerate(paths):
        same(got[i], alone([tree.tokens[j] for j in path]))
    path = [0, 4, 5]  # a, e, c: the third candidate's branch, which must move down two positions
    assert [tree.tokens[i] for i in path] == [a, e, c] and paths[5] == path
    want = alone([a, e, c, d])
    runner.kv_truncate(0, start)
    runner.forward(batch)
    runner.kv_compact(0, start, path)
    assert runner.seq_len[0] == start + len(path)
    after = Batch()
    after.add_sequence([d], start + len(path), 0)
    same(runner.forward(after)[0], want)
    runner.kv_truncate(0, 0)


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
