"""HostCopies and PendingTokens: values computed on the device come back (CPU, and CUDA on the GPU
machine)."""

from __future__ import annotations

import pytest
import torch

from specserve.engine.host_copy import HostCopies, PendingTokens

DEVICES = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_copies_read_back_what_the_device_computed(device: torch.device) -> None:
    copies = HostCopies(device, 2, 8)
    for round_ in range(3):  # slots are reused once read
        values = (torch.arange(12, device=device) * (round_ + 1) - 5) * 2  # device work
        copies.start(round_ % 2, values[:8])
        copies.start((round_ + 1) % 2, values[4:])  # a slice that does not start at the storage's start
        expected = (torch.arange(12) * (round_ + 1) - 5) * 2
        assert copies.read(round_ % 2, 8) == expected[:8].tolist()
        assert copies.read((round_ + 1) % 2, 8) == expected[4:].tolist()


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_pending_tokens_read_what_the_step_computed(device: torch.device) -> None:
    values = torch.tensor([3, 1, 4, 1, 5], device=device)
    assert PendingTokens(values * 2).read() == [6, 2, 8, 2, 10]  # a tensor (the eager path)
    done = torch.cuda.Event() if device.type == "cuda" else None
    host = torch.zeros(5, dtype=torch.long, pin_memory=device.type == "cuda")
    host.copy_(values + 1, non_blocking=True)  # what a step graph's last node does
    if done is not None:
        done.record()
    assert PendingTokens(host.numpy()[:3], done).read() == [4, 2, 5]
