"""Whether a tensor's op should run as a Triton kernel (kernels/settings.py: Triton installed and not switched
off; CUDA tensors, or CPU ones under TRITON_INTERPRET=1, as the kernel tests run them where Triton is installed)."""

from __future__ import annotations

import torch

from specserve.kernels.settings import HAVE_TRITON, settings

__all__ = ["HAVE_TRITON", "triton_device", "triton_enabled"]


def triton_device(device: torch.device | str) -> bool:
    """Whether ops on tensors of `device` run as Triton kernels (what a loader asks before choosing a layout)."""
    s = settings()
    return s.triton and (torch.device(device).type == "cuda" or s.triton_interpret)


def triton_enabled(t: torch.Tensor) -> bool:
    s = settings()
    return s.triton and (t.is_cuda or s.triton_interpret)
