"""logit_bias: fixed amounts added to chosen tokens' logits before any sampling stage (llama.cpp's first
sampler), -inf meaning "never".

A task with a bias is never `greedy_only` (slots.py): its rows take the logits path, where the bias is
added before the argmax or the sampler, so a draft token the bias forbids cannot be its row's choice and is
rejected like any mismatch (speculation never lets a forbidden token through).
"""

from __future__ import annotations

import math

import torch


class LogitBias:
    """token id -> amount (several entries for one token add up, as llama.cpp's sampler adds each)."""

    def __init__(self, bias: dict[int, float]):
        self.bias = dict(bias)
        self._ids = torch.tensor(list(self.bias), dtype=torch.long)
        self._values = torch.tensor(list(self.bias.values()), dtype=torch.float32)
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __bool__(self) -> bool:
        return bool(self.bias)

    def apply(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, vocab] plus the bias (a new tensor: the raw rows stay for log-probabilities)."""
        if rows.device not in self._on:  # one host->device copy per task and device, not per step
            self._on[rows.device] = (self._ids.to(rows.device), self._values.to(rows.device))
        ids, values = self._on[rows.device]
        out = rows.float().clone()
        out[:, ids] += values
        return out

    def to_json(self) -> list[dict[str, object]]:
        """As llama-server's generation_settings shows it; "never" is false (JSON has no -inf)."""
        return [{"token": t, "bias": False if b == -math.inf else b} for t, b in self.bias.items()]
