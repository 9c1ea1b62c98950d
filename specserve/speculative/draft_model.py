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
from specserve.model.kv_ledger import KVLedger
from specserve.speculative.base import Speculator

TOP_K = 10


class DraftRunner(Protocol):
    """What the draft speculator needs of the draft model's runner (engine.runner.Runner has it)."""

    n_ctx: int
    seq_len: list[int]
    ledger: KVLedger

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
        return draft_together([(self, history, last_sampled, n_max)])[0]


DraftModelAsk = tuple[DraftModelSpeculator, list[int], int, int]  # a ProposeAsk of a draft-model speculator


def draft_together(requests: list[DraftModelAsk]) -> list[list[int]]:
    """Each request's draft (speculator, history, last sampled, n_max), its draft-model speculators sharing one
    runner (a sequence each): the tokens new to their caches in one forward (each alone where that would pass
    n_batch rows), then one forward per draft token for all that still draft. The draft runner's KV pool also
    holds sequences that are not asking (idle slots'): short of room, their caches go first; still short, nobody
    drafts this time."""
    drafts: list[list[int]] = [[] for _ in requests]
    live, spans = [], []
    for i, (spec, history, last, n_max) in enumerate(requests):
        context = [*history, last]
        if len(context) + n_max > spec.runner.n_ctx:
            continue
        # always evaluate the newest token; the cache may have been given up for room meanwhile
        keep = min(common_prefix(spec.cached, context), len(context) - 1, spec.runner.seq_len[spec.seq])
        spec.runner.kv_truncate(spec.seq, keep)
        spec.cached = context[:keep]
        live.append(i)
        spans.append((keep, context))
    if not live or not _room(requests, live, spans):
        return drafts
    for i, (_, context) in zip(live, spans, strict=True):
        requests[i][0].cached = context
    runner = requests[live[0]][0].runner
    if sum(len(c) - keep for keep, c in spans) <= requests[live[0]][0].n_batch:
        batch = Batch()
        for i, (keep, context) in zip(live, spans, strict=True):
            batch.add_sequence(context[keep:], keep, requests[i][0].seq, "last")
        logits = runner.forward(batch)
    else:  # a new prompt's whole suffix: in chunks, sequence by sequence
        logits = torch.stack([_evaluate(runner, requests[i][0].seq, context, keep, requests[i][0].n_batch)
                              for i, (keep, context) in zip(live, spans, strict=True)])
    while live:
        top = torch.topk(logits, TOP_K, dim=-1)  # the runner's logits are fp32
        probs = torch.softmax(top.values, dim=-1)
        picked = torch.stack((probs[:, 0], top.indices[:, 0].to(probs.dtype)), dim=1).tolist()  # one transfer
        batch, still = Batch(), []
        for i, (p, token) in zip(live, picked, strict=True):
            spec, n_max = requests[i][0], requests[i][3]
            if p < spec.p_min:
                continue
            drafts[i].append(int(token))
            if len(drafts[i]) >= n_max:
                continue
            batch.add(int(token), len(spec.cached), spec.seq, logits=True)
            spec.cached.append(int(token))
            still.append(i)
        live = still
        if live:
            logits = runner.forward(batch)
    return drafts


def _room(requests: list[DraftModelAsk], live: list[int], spans: list[tuple[int, list[int]]]) -> bool:
    """Whether the draft runner's pool holds what these asks evaluate (their new tokens and drafts but the last),
    after giving up the caches of the sequences not asking."""
    runner = requests[live[0]][0].runner
    blocks = runner.ledger.blocks
    asking = {requests[i][0].seq for i in live}

    def need() -> int:
        return sum(blocks.need(requests[i][0].seq, keep, len(context) + requests[i][3] - 1)
                   for i, (keep, context) in zip(live, spans, strict=True))

    for seq in range(len(runner.seq_len)):
        if need() <= blocks.free:
            return True
        if seq not in asking and runner.seq_len[seq] > 0:
            runner.kv_truncate(seq, 0)
    return need() <= blocks.free


# (the Speculator's type says any speculator; draft_chains passes this one only speculators of this type)
DraftModelSpeculator.propose_together = staticmethod(draft_together)  # type: ignore[assignment]
