"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch

from specserve.kernels import cpu_ops
from specserve.kernels.dispatch import triton_enabled


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * weight / sqrt(mean(x^2) + eps), computed in fp32, returned in x's dtype."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the new residual stream and its norm."""
    summed = x + residual
    return rms_norm_ref(summed, weight, eps), summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if triton_enabled(x):
        from specserve.kernels import rmsnorm_triton

        return rmsnorm_triton.rms_norm(x, weight, eps)
    if cpu_ops.takes(x, weight):
        return cpu_ops.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if triton_enabled(x):
        from specserve.kernels import rmsnorm_triton

        return rmsnorm_triton.add_rms_norm(x, residual, weight, eps)
    if x.shape == residual.shape and cpu_ops.takes(x, residual, weight):
        return cpu_ops.add_rms_norm(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)
