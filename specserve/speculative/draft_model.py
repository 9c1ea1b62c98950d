"""Draft-model speculation: a smaller model with the same vocabulary proposes tokens.

The draft keeps its own KV cache across steps and across generations: each call
evaluates only the tokens past the longest common prefix with what its cache holds (the
accepted part of the previous draft plus the newest sampled token; for a new prompt, its
new suffix), then drafts greedily until the top token's probability (among the top 10,
as llama.cpp's draft sampler computes it) falls below p_min.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from specserve.engine.batch import Batch, common_prefix
from specserve.engine.generate import prefill
from specserve.engine.runner import LocalRunner
from specserve.errors import SpecserveError
from specserve.speculative.base import Speculator

VOCAB_SIZE_SLACK = 128  # llama.cpp's SPEC_VOCAB_MAX_SIZE_DIFFERENCE
VOCAB_CHECK_START = 5  # llama.cpp's SPEC_VOCAB_CHECK_START_TOKEN_ID
TOP_K = 10


def check_vocab_compatible(target: dict[str, Any], draft: dict[str, Any]) -> None:
    """Refuse a draft model whose tokenizer differs from the target's (GGUF metadata)."""

    def meta(m: dict[str, Any], key: str) -> Any:
        return m.get(f"tokenizer.ggml.{key}")

    problems = []
    if meta(target, "model") != meta(draft, "model"):
        problems.append(f"tokenizer type {meta(draft, 'model')} != {meta(target, 'model')}")
    for key in ("bos_token_id", "eos_token_id", "add_bos_token", "add_eos_token"):
        if meta(target, key) != meta(draft, key):
            problems.append(f"{key} {meta(draft, key)} != {meta(target, key)}")
    t_tokens, d_tokens = meta(target, "tokens") or [], meta(draft, "tokens") or []
    if abs(len(t_tokens) - len(d_tokens)) > VOCAB_SIZE_SLACK:
        problems.append(f"vocabulary sizes {len(d_tokens)} and {len(t_tokens)} differ by more than "
                        f"{VOCAB_SIZE_SLACK}")
    else:
        for i in range(VOCAB_CHECK_START, min(len(t_tokens), len(d_tokens))):
            if t_tokens[i] != d_tokens[i]:
                problems.append(f"token {i} is {d_tokens[i]!r} in the draft but {t_tokens[i]!r} in the target")
                break
    if problems:
        raise SpecserveError("the draft model is not compatible with the target: " + "; ".join(problems))


def load_with_draft(target: Path, draft: Path | None, **runner_args: Any) -> tuple[LocalRunner, LocalRunner | None]:
    """The target's runner and, if a draft model is given, the draft's: same settings and context
    size, vocabulary checked against the target's."""
    runner = LocalRunner(target, **runner_args)
    if draft is None:
        return runner, None
    draft_runner = LocalRunner(draft, **{**runner_args, "n_ctx": runner.n_ctx})
    check_vocab_compatible(runner.gguf.metadata, draft_runner.gguf.metadata)
    return runner, draft_runner


class DraftModelSpeculator(Speculator):
    name = "draft"

    def __init__(self, runner: LocalRunner, p_min: float, seq: int = 0, n_batch: int = 512):
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
        logits = prefill(self.runner, self.seq, context, self.n_batch, start=keep)
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
