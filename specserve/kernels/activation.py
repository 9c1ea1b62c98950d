"""SwiGLU activation on a fused gate|up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.kernels import cpu_ops
from specserve.kernels.dispatch import triton_enabled


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, where gate_up = [gate | up] along the last dimension."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """One kernel instead of torch's two (silu, then mul): at decode the launch is the cost."""
    if triton_enabled(gate_up):
        from specserve.kernels import activation_triton

        return activation_triton.silu_mul(gate_up)
    if cpu_ops.takes(gate_up):
        return cpu_ops.silu_mul(gate_up)
    return silu_mul_ref(gate_up)
