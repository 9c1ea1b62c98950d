"""Whether a tensor's op should run as a Triton kernel.

Triton runs on CUDA tensors; TRITON_INTERPRET=1 (Triton's CPU interpreter) lets the
kernels run on CPU tensors too, which the kernel tests use where Triton is installed.
SPECSERVE_NO_TRITON=1 forces the torch references everywhere (for A/B comparisons).
"""

from __future__ import annotations

import importlib.util
import os

import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def triton_device(device: torch.device | str) -> bool:
    """Whether ops on tensors of `device` run as Triton kernels (what a loader asks before choosing a layout)."""
    if not HAVE_TRITON or os.environ.get("SPECSERVE_NO_TRITON") == "1":
        return False
    return torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def triton_enabled(t: torch.Tensor) -> bool:
    if not HAVE_TRITON or os.environ.get("SPECSERVE_NO_TRITON") == "1":
        return False
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
