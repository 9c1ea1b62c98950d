"""Small helpers several tests share."""

from __future__ import annotations

import torch

from specserve.model.batch import Batch


def prefill(runner, seq: int, tokens: list[int], n_batch: int = 512, start: int = 0) -> torch.Tensor:
    """Evaluate tokens[start:] of sequence seq in chunks of n_batch; the logits of the last token."""
    logits = None
    for chunk_start in range(start, len(tokens), n_batch):
        batch = Batch()
        batch.add_sequence(tokens[chunk_start:chunk_start + n_batch], chunk_start, seq, "last")
        logits = runner.forward(batch)[0]
    assert logits is not None
    return logits
