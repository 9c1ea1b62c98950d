"""Linear layers over float matrices or group-quantized, bit-packed integer matrices (quant_weight.py).

The Triton kernels cover 1..16 rows (decode and verify steps) and can fuse SwiGLU into their
input and the bias into their output. More rows (prefill) dequantize to the activation dtype
and use cuBLAS, where arithmetic, not bytes, dominates. Triton's float kernel beats cuBLAS for
one row on every projection of qwen2.5-coder-1.5b, so one-row float products
use it; cuBLAS keeps every multi-row float product.

A packed matrix may also carry a dense copy (`QuantWeight.dense`, the same dequantized values, made
once at load where memory allows): products of more rows than one sequence's step takes (a batch of
many sequences' decode rows, prompt chunks) then run on cuBLAS over it instead of in 16-row slices of
the packed kernel or dequantizing every step. Batch-invariant steps keep the packed kernel.

Which kernel runs a product is the runner's kernels' choice (triton_kernels.py, cpu_kernels.py); here are the
reference and the rule for dense copies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.kernels.activation import silu_mul_ref
from specserve.kernels.quant_weight import MAX_GEMV_ROWS, QuantWeight, Weight, dequantize_ref

# Products of at least this many rows use a matrix's dense copy where it has one. One sequence's step stays
# below it (LocalRunner.draft_limit keeps a verify step within MAX_GEMV_ROWS on packed weights), so its rows
# compute what its decode rows compute.
DENSE_MIN_ROWS = MAX_GEMV_ROWS + 1


def linear_ref(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None, silu_input: bool = False,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = act(x) @ W^T + bias, act = silu_mul when silu_input (x is then [.., 2K]); y in out_dtype."""
    if silu_input:
        x = silu_mul_ref(x)
    weight = dequantize_ref(w, x.dtype) if isinstance(w, QuantWeight) else w
    y = F.linear(x, weight, bias)
    return y if out_dtype is None else y.to(out_dtype)


def dense_copy(x: torch.Tensor, w: Weight, invariant: bool = False) -> torch.Tensor | None:
    """The dense copy of packed w that a product with x's rows runs on, if any (module docstring); none on
    batch-invariant steps."""
    if not isinstance(w, QuantWeight) or w.dense is None or w.dense.dtype != x.dtype or invariant:
        return None
    rows = x.numel() // x.shape[-1]
    return w.dense if rows >= DENSE_MIN_ROWS else None
