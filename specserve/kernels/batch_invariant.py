"""Batch-invariant products on CUDA: a row's bits never depend on the other rows of its step.

cuBLAS picks its kernel (tiles, split-K) by the row count, so the same row summed in a step of 1, 7 or
300 rows can come out in different bits, and greedy text then depends on what else the server runs.
With the mode on, every float product runs as cuBLAS calls of exactly INVARIANT_ROWS rows (the last
slice padded with zeros): one shape, one kernel, and rows do not mix in a product. Packed weights take
the tensor-core row kernels for any row count (16-row slices, the same instructions for every row; see
quant_cuda), prompt chunks included. Attention, norms, RoPE and sampling are per-row kernels already.

Off by default (its cost: docs/perf.md); `--batch-invariant` or SPECSERVE_BATCH_INVARIANT=1 turns it on.
The CPU kernels are batch-invariant without it.
"""

from __future__ import annotations

import os

import torch

INVARIANT_ROWS = int(os.environ.get("SPECSERVE_INVARIANT_ROWS", "64"))  # rows of every float product call
_enabled = os.environ.get("SPECSERVE_BATCH_INVARIANT", "0") == "1"


def enabled() -> bool:
    return _enabled


def enable(on: bool = True) -> None:
    """Set before a model is loaded: CUDA graphs captured earlier keep the kernels they captured."""
    global _enabled
    _enabled = on


def applies(x: torch.Tensor) -> bool:
    return _enabled and x.is_cuda


def linear_float(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ w^T (+ bias) as calls of INVARIANT_ROWS rows each, whatever x's row count."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    padded = -(-rows // INVARIANT_ROWS) * INVARIANT_ROWS
    if padded != rows:
        x2 = torch.cat([x2, x2.new_zeros(padded - rows, k)])
    out = torch.empty((padded, w.shape[0]), dtype=x.dtype, device=x.device)
    wt = w.t()
    for i in range(0, padded, INVARIANT_ROWS):
        if bias is None:
            torch.mm(x2[i:i + INVARIANT_ROWS], wt, out=out[i:i + INVARIANT_ROWS])
        else:
            torch.addmm(bias, x2[i:i + INVARIANT_ROWS], wt, out=out[i:i + INVARIANT_ROWS])
    return out[:rows].view(*x.shape[:-1], w.shape[0])
