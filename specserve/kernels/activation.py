"""SwiGLU activation on a fused gate|up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, where gate_up = [gate | up] along the last dimension."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
