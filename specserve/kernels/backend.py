"""The one place that decides which kernels a runner's ops run: when the runner is built, from its device, the
kernel switches (settings.py, read from the environment once) and batch invariance.

- Triton installed and not switched off, on CUDA (or on the CPU under Triton's interpreter): TritonKernels.
- The CPU with the C kernels (not switched off by SPECSERVE_CPU_KERNEL=0): CpuKernels.
- Anything else: torch's references (TorchKernels).

Each is one object with the ops as methods (torch_kernels.py); the model's step ops call what was chosen.
"""

from __future__ import annotations

import torch

from specserve.kernels import batch_invariant
from specserve.kernels.cpu_kernels import CpuKernels
from specserve.kernels.settings import KernelSettings, settings
from specserve.kernels.torch_kernels import TorchKernels

__all__ = ["TorchKernels", "kernels_for", "triton_device"]


def triton_device(device: torch.device | str, kernel_settings: KernelSettings | None = None) -> bool:
    """Whether ops on `device` run as Triton kernels."""
    s = kernel_settings or settings()
    return s.triton and (torch.device(device).type == "cuda" or s.triton_interpret)


def kernels_for(device: torch.device | str, *, invariant: bool | None = None,
                kernel_settings: KernelSettings | None = None) -> TorchKernels:
    """The kernels for a runner on `device`. invariant: batch-invariant products (None: as
    `batch_invariant.enabled()`, the --batch-invariant switch; they apply on CUDA only)."""
    s = kernel_settings or settings()
    device = torch.device(device)
    invariant = (batch_invariant.enabled() if invariant is None else invariant) and device.type == "cuda"
    if triton_device(device, s):
        from specserve.kernels.triton_kernels import TritonKernels  # (imports Triton)

        return TritonKernels(s, invariant)
    if device.type == "cpu" and s.cpu_kernel:
        return CpuKernels(s, invariant)
    return TorchKernels(s, invariant)
