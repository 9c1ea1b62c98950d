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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.kernels import batch_invariant
from specserve.kernels.activation import silu_mul, silu_mul_ref
from specserve.kernels.dispatch import triton_enabled
from specserve.kernels.quant_weight import MAX_GEMV_ROWS, MAX_SLICED_ROWS, QuantWeight, Weight, dequantize_ref
from specserve.kernels.settings import settings

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


def _triton_gemv_float(rows: int) -> bool:
    """One row over a float matrix (SPECSERVE_TRITON_GEMV=0: always cuBLAS, for A/B runs)."""
    return rows == 1 and settings().triton_gemv


def dense_copy(x: torch.Tensor, w: Weight) -> torch.Tensor | None:
    """The dense copy of packed w that a product with x's rows runs on, if any (module docstring)."""
    if not isinstance(w, QuantWeight) or w.dense is None or w.dense.dtype != x.dtype:
        return None
    rows = x.numel() // x.shape[-1]
    return w.dense if rows >= DENSE_MIN_ROWS and not batch_invariant.applies(x) else None


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None, silu_input: bool = False,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    dense = dense_copy(x, w)
    w = w if dense is None else dense
    packed = w if isinstance(w, QuantWeight) else None  # (None: a float matrix)
    cpu_packed = None if packed is None or x.is_cuda else packed
    if cpu_packed is not None and not triton_enabled(x):  # first: a CPU decode step makes ~120 of these
        from specserve.kernels import quant_cpu

        y = quant_cpu.product(x, cpu_packed, bias, silu_input, out_dtype)
        if y is not None:
            return y
    rows = x.numel() // x.shape[-1]
    invariant = batch_invariant.applies(x)
    if packed is not None and (rows <= MAX_SLICED_ROWS or invariant) and triton_enabled(x):
        from specserve.kernels import quant_cuda

        kernel = quant_cuda.usable(x, packed, bias, out_dtype or x.dtype)
        if kernel:
            return quant_cuda.gemv(x, packed, bias, silu_input, out_dtype or x.dtype, kernel=kernel)
    if invariant:  # one kernel for every row count: float products in fixed slices
        weight = dequantize(w, x.dtype) if isinstance(w, QuantWeight) else w
        y = batch_invariant.linear_float(silu_mul(x) if silu_input else x, weight, bias)
        return y if out_dtype is None else y.to(out_dtype)
    if rows <= MAX_GEMV_ROWS and triton_enabled(x) and (packed is not None or _triton_gemv_float(rows)):
        from specserve.kernels import linear_triton

        return linear_triton.gemv(x, w, bias, silu_input, out_dtype or x.dtype)
    if silu_input:
        x = silu_mul(x)
    if cpu_packed is not None:  # (reached here under Triton's interpreter only)
        from specserve.kernels import quant_cpu

        y = quant_cpu.product(x, cpu_packed, bias, False, out_dtype)
        if y is not None:
            return y
    weight = dequantize(w, x.dtype) if isinstance(w, QuantWeight) else w
    y = F.linear(x, weight, bias)
    return y if out_dtype is None else y.to(out_dtype)


def dequantize(w: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    if triton_enabled(w.words):
        from specserve.kernels import linear_triton

        return linear_triton.dequantize(w, dtype)
    return dequantize_ref(w, dtype)
