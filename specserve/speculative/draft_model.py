"""Draft-model speculation: a smaller model with the same vocabulary proposes tokens.

The draft keeps its own KV cache across steps and across generations: each call
evaluates only the tokens past the longest common prefix with what its cache holds (the
accepted part of the previous draft plus the newest sampled token; for a new prompt, its
new suffix), then drafts greedily until the top token's probability (among the top 10,
as llama.cpp's draft sampler computes it) falls below p_min.
"""

from __future__ import annotations

from typing import Protocol

import torch

from specserve.model.batch import Batch, common_prefix
from specserve.speculative.base import Speculator

TOP_K = 10


class DraftRunner(Protocol):
    """What the draft speculator needs of the draft model's runner (engine.runner.Runner has it)."""

    n_ctx: int

    def forward(self, batch: Batch) -> torch.Tensor: ...
    def kv_truncate(self, seq: int, n_keep: int) -> None: ...


def _evaluate(runner: DraftRunner, seq: int, tokens: list[int], start: int, n_batch: int) -> torch.Tensor:
    """Evaluate tokens[start:] (positions start..) in chunks of n_batch; the logits of the last one."""
    logits = None
    for chunk_start in range(start, len(tokens), n_batch):
        chunk = tokens[chunk_start:chunk_start + n_batch]
        batch = Batch()
        batch.add_sequence(chunk, chunk_start, seq, "last")
        logits = runner.forward(batch)[0]
    assert logits is not None, "at least one token to evaluate"
    return logits


class DraftModelSpeculator(Speculator):
    name = "draft"

    def __init__(self, runner: DraftRunner, p_min: float, seq: int = 0, n_batch: int = 512):
        super().__init__()
        self.runner = runner
        self.p_min = p_min
        self.seq = seq
        self.n_batch = n_batch
        self.cached: list[int] = []  # tokens whose K/V sit in the draft's cache for `seq`

    def _propose(self, history: list[int], last_sampled: int, n_max: int) -> list[int]:
        context = [*history, last_sampled]
        if len(context) + n_max > self.runner.n_ctx:
            return []
        keep = min(common_prefix(self.cached, context), len(context) - 1)  # always evaluate at least the newest token
        self.runner.kv_truncate(self.seq, keep)
        logits = _evaluate(self.runner, self.seq, context, keep, self.n_batch)
        self.cached = context
        draft: list[int] = []
        while True:
            top = torch.topk(logits, TOP_K)  # the runner's logits are fp32
            probs = torch.softmax(top.values, dim=-1)
            p, token = torch.stack((probs[0], top.indices[0].to(probs.dtype))).tolist()  # one transfer
            token = int(token)
            if p < self.p_min:
                break
            draft.append(token)
            if len(draft) >= n_max:
                break
            batch = Batch()
            batch.add(token, len(self.cached), self.seq, logits=True)
            logits = self.runner.forward(batch)[0]
            self.cached.append(token)
        return draft
