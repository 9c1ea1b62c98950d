"""Linear layers over float matrices or group-quantized integer matrices.

`QuantWeight` holds W = q * scale - min with q int8 and one fp32 scale (and min) per group of
16 or 32 consecutive k. Every GGUF block format the loader reads (Q8_0, Q4_0/1, Q5_0/1,
Q4_K, Q5_K, Q6_K) is exactly this shape, so a file's quantized matrices stay as they are on
the GPU (specserve.gguf.repack), ~1.25 bytes per weight instead of 2. Float matrices can be
quantized with Q8_0's rule (`quantize_q8`). (On an H200 the quantized kernel is still slower
than bf16 for decode: benchmarks/results/kernel_notes.md, v3.)

The Triton kernel covers 1..16 rows (decode and verify steps): it dequantizes in registers
and can fuse SwiGLU into its input and the bias into its output. More rows (prefill)
dequantize to the activation dtype and use cuBLAS, where arithmetic, not bytes, dominates.
Triton's float kernel beats cuBLAS for one row on every projection of qwen2.5-coder-1.5b
(H200: [1536, 1536] 3.8 vs 6.4 us, [17920, 1536] 16.4 vs 17.9, [151936, 1536] 109 vs 117;
kernel_notes.md), so one-row float products use it; cuBLAS keeps every multi-row product.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specserve.errors import SpecserveError
from specserve.kernels.activation import silu_mul, silu_mul_ref
from specserve.kernels.dispatch import triton_enabled

Q8_BLOCK = 32  # weights per scale, as GGUF's Q8_0
MAX_GEMV_ROWS = 16  # above this, cuBLAS on bf16 wins (arithmetic-bound)


@dataclass
class QuantWeight:
    """W = q * scale - min, per group of `group` consecutive k: q int8 [N, K]; scale, min fp32 [N, K / group]."""

    q: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None
    group: int
    small: bool = field(init=False)  # every q in [-64, 63] (4- to 6-bit formats): the kernel's fast path

    def __post_init__(self) -> None:
        self.small = bool(self.q.numel() == 0 or (self.q.min() >= -64 and self.q.max() <= 63))

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def n_bytes(self) -> int:
        extra = 0 if self.min is None else self.min.numel() * 4
        return self.q.numel() + self.scale.numel() * 4 + extra


Weight = torch.Tensor | QuantWeight


def quantize_q8(w: torch.Tensor, chunk_rows: int = 8192) -> QuantWeight:
    """Q8_0's rule (d = amax / 127, q = round(w / d), d rounded to fp16); a Q8_0 GGUF tensor
    dequantized to fp32 comes back exactly. Chunked so the fp32 temporaries stay small."""
    n, k = w.shape
    if k % Q8_BLOCK:
        raise SpecserveError(f"Q8 weights need an input size divisible by {Q8_BLOCK}, got {k}")
    q = torch.empty((n, k), dtype=torch.int8, device=w.device)
    scale = torch.empty((n, k // Q8_BLOCK), dtype=torch.float32, device=w.device)
    for r in range(0, n, chunk_rows):
        blocks = w[r : r + chunk_rows].float().view(-1, k // Q8_BLOCK, Q8_BLOCK)
        d = (blocks.abs().amax(-1) / 127.0).half().float()
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        q[r : r + chunk_rows] = (blocks * inv[..., None]).round().clamp(-127, 127).to(torch.int8).view(-1, k)
        scale[r : r + chunk_rows] = d
    return QuantWeight(q, scale, None, Q8_BLOCK)


def dequantize_ref(w: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """q * scale - min in fp32 (the order GGUF's own decoders use), then `dtype`."""
    n, k = w.q.shape
    blocks = w.q.view(n, k // w.group, w.group).float() * w.scale[..., None]
    if w.min is not None:
        blocks = blocks - w.min[..., None]
    return blocks.view(n, k).to(dtype)


def concat_quant(parts: list[QuantWeight]) -> QuantWeight:
    """Stack matrices along N (Q, K, V -> QKV) on a common group size, a zero min where one has none."""
    group = min(p.group for p in parts)
    has_min = any(p.min is not None for p in parts)

    def expand(t: torch.Tensor | None, p: QuantWeight) -> torch.Tensor:
        if t is None:
            t = torch.zeros_like(p.scale)
        return t.repeat_interleave(p.group // group, dim=1)

    return QuantWeight(torch.cat([p.q for p in parts]), torch.cat([expand(p.scale, p) for p in parts]),
                       torch.cat([expand(p.min, p) for p in parts]) if has_min else None, group)


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
    return rows == 1 and os.environ.get("SPECSERVE_TRITON_GEMV") != "0"


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None, silu_input: bool = False,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    quant = isinstance(w, QuantWeight)
    if rows <= MAX_GEMV_ROWS and triton_enabled(x) and (quant or _triton_gemv_float(rows)):
        from specserve.kernels import linear_triton

        return linear_triton.gemv(x, w, bias, silu_input, out_dtype or x.dtype)
    if silu_input:
        x = silu_mul(x)
    weight = dequantize(w, x.dtype) if quant else w
    y = F.linear(x, weight, bias)
    return y if out_dtype is None else y.to(out_dtype)


def dequantize(w: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    if triton_enabled(w.q):
        from specserve.kernels import linear_triton

        return linear_triton.dequantize(w, dtype)
    return dequantize_ref(w, dtype)
