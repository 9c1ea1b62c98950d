"""PinnedUpload, HostCopies and PendingTokens: values reach the device and come back (CPU, and CUDA on the GPU
machine)."""

from __future__ import annotations

import pytest
import torch

from specserve.engine.host_copy import HostCopies, PendingTokens, PinnedUpload

DEVICES = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_upload_then_read_back(device: torch.device) -> None:
    upload = PinnedUpload(device, 16)
    copies = HostCopies(device, 2, 8)
    dst = torch.zeros((3, 4), dtype=torch.long, device=device)
    for round_ in range(3):  # the staging buffer is reused once the last upload has landed
        expected = torch.arange(12).view(3, 4) * (round_ + 1) - 5
        upload.stage((3, 4))[:] = expected.numpy()
        upload.upload(dst)
        doubled = (dst * 2).flatten()  # device work behind the upload
        copies.start(round_ % 2, doubled[:8])
        copies.start((round_ + 1) % 2, doubled[4:])  # a slice that does not start at the storage's start
        assert copies.read(round_ % 2, 8) == (expected.flatten()[:8] * 2).tolist()
        assert copies.read((round_ + 1) % 2, 8) == (expected.flatten()[4:] * 2).tolist()


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
