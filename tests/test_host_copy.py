"""LaunchedStep: a step's argmax and logits come back (CPU, and CUDA on the GPU machine)."""

from __future__ import annotations

import pytest
import torch

from specserve.engine.host_copy import LaunchedStep

DEVICES = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_launched_step_reads_what_the_step_computed(device: torch.device) -> None:
    logits = torch.randn(5, 7, device=device)
    argmax = logits.argmax(dim=-1)
    eager = LaunchedStep(logits, argmax, 5)  # a tensor (the eager path)
    assert eager.tokens() == argmax.tolist() and eager.logits() is logits
    done = torch.cuda.Event() if device.type == "cuda" else None
    host = torch.zeros(8, dtype=torch.long, pin_memory=device.type == "cuda")
    host[:5].copy_(argmax, non_blocking=True)  # what a step graph's last node does
    if done is not None:
        done.record()
    assert LaunchedStep(logits[:3], host.numpy(), 3, done).tokens() == argmax[:3].tolist()
    wanted = [1, 4]  # a graph over every row, of which the batch wanted two
    assert LaunchedStep(logits[wanted], host.numpy(), 2, done, rows=wanted).tokens() == argmax[wanted].tolist()
