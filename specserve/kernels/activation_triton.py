"""Triton SwiGLU: silu(gate) * up in one pass over the fused gate|up rows."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(x_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    # torch rounds silu(g) to the storage dtype before the product; do the same
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    x = gate_up.reshape(-1, gate_up.shape[-1]).contiguous()
    n_rows, two_f = x.shape
    n_cols = two_f // 2
    out = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    block = min(2048, triton.next_power_of_2(n_cols))
    _silu_mul_kernel[(n_rows, triton.cdiv(n_cols, block))](x, out, n_cols, BLOCK=block, num_warps=4)
    return out.view(*gate_up.shape[:-1], n_cols)
