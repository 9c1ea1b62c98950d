"""Linear layers over bf16 or Q8 (int8, one fp16 scale per 32 weights) matrices.

Q8 halves the bytes a decode step reads: at batch 1 every weight is read once per token,
so bytes set the floor. Its Triton kernel dequantizes in registers for 1..16 rows (decode
and verify steps) and can fuse SwiGLU into its input and the bias into its output; more
rows (prefill) dequantize to bf16 and use cuBLAS, where arithmetic, not bytes, dominates.

The same kernel on bf16 weights beats cuBLAS for one row on the smaller matrices (measured
on an H200: [1536, 1536] 4.0 vs 6.8 us; benchmarks/results/kernel_notes.md), so it is used
there; cuBLAS keeps the large ones and every multi-row bf16 product.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.errors import SpecserveError
from specserve.kernels.activation import silu_mul, silu_mul_ref
from specserve.kernels.dispatch import triton_enabled

Q8_BLOCK = 32  # weights per scale, as GGUF's Q8_0
MAX_GEMV_ROWS = 16  # above this, cuBLAS on bf16 wins (arithmetic-bound)
BF16_GEMV_MAX_WEIGHTS = 16 << 20  # one-row bf16 products up to this size run the Triton kernel


@dataclass
class Q8Weight:
    """W ~= q * scale: q int8 [N, K], scale fp16 [N, K / 32] (one per 32 consecutive k)."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    def n_bytes(self) -> int:
        return self.q.numel() + self.scale.numel() * self.scale.element_size()


Weight = torch.Tensor | Q8Weight


def quantize_q8(w: torch.Tensor, chunk_rows: int = 8192) -> Q8Weight:
    """Q8_0's rule (d = amax / 127, q = round(w / d), d stored as fp16); a Q8_0 GGUF tensor
    dequantized to fp32 comes back exactly. Chunked so the fp32 temporaries stay small."""
    n, k = w.shape
    if k % Q8_BLOCK:
        raise SpecserveError(f"Q8 weights need an input size divisible by {Q8_BLOCK}, got {k}")
    q = torch.empty((n, k), dtype=torch.int8, device=w.device)
    scale = torch.empty((n, k // Q8_BLOCK), dtype=torch.float16, device=w.device)
    for r in range(0, n, chunk_rows):
        blocks = w[r : r + chunk_rows].float().view(-1, k // Q8_BLOCK, Q8_BLOCK)
        d = (blocks.abs().amax(-1) / 127.0).half()
        df = d.float()
        inv = torch.where(df > 0, 1.0 / df, torch.zeros_like(df))
        q[r : r + chunk_rows] = (blocks * inv[..., None]).round().clamp(-127, 127).to(torch.int8).view(-1, k)
        scale[r : r + chunk_rows] = d
    return Q8Weight(q, scale)


def dequantize_q8(w: Q8Weight, dtype: torch.dtype) -> torch.Tensor:
    n, k = w.q.shape
    blocks = w.q.view(n, k // Q8_BLOCK, Q8_BLOCK).float() * w.scale.float()[..., None]
    return blocks.view(n, k).to(dtype)


def linear_ref(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None, silu_input: bool = False,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = act(x) @ W^T + bias, act = silu_mul when silu_input (x is then [.., 2K]); y in out_dtype."""
    if silu_input:
        x = silu_mul_ref(x)
    weight = dequantize_q8(w, x.dtype) if isinstance(w, Q8Weight) else w
    y = F.linear(x, weight, bias)
    return y if out_dtype is None else y.to(out_dtype)


def _triton_gemv_bf16(rows: int, w: torch.Tensor) -> bool:
    """One row over a small bf16 matrix (SPECSERVE_TRITON_GEMV=0: always cuBLAS, for A/B runs)."""
    return rows == 1 and w.numel() <= BF16_GEMV_MAX_WEIGHTS and os.environ.get("SPECSERVE_TRITON_GEMV") != "0"


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None, silu_input: bool = False,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    quant = isinstance(w, Q8Weight)
    if rows <= MAX_GEMV_ROWS and triton_enabled(x) and (quant or _triton_gemv_bf16(rows, w)):
        from specserve.kernels import linear_triton

        return linear_triton.gemv(x, w.q if quant else w, w.scale if quant else None, bias, silu_input,
                                  out_dtype or x.dtype)
    if silu_input:
        x = silu_mul(x)
    weight = dequantize(w, x.dtype) if quant else w
    y = F.linear(x, weight, bias)
    return y if out_dtype is None else y.to(out_dtype)


def dequantize(w: Q8Weight, dtype: torch.dtype) -> torch.Tensor:
    if triton_enabled(w.q):
        from specserve.kernels import linear_triton

        return linear_triton.dequantize(w.q, w.scale, dtype)
    return dequantize_q8(w, dtype)
