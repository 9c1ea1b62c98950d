"""Triton matrix-vector kernels for 1..16 rows over int8 (Q8) or bf16 weights.

One program owns BLOCK_N output columns and walks all of K, so each weight is read
once per step whatever the row count. One row over a matrix of few output columns:
multiply-add on CUDA cores, few columns per program so all SMs get work. Otherwise:
tensor-core dot with the rows padded to 16 (measured faster even for one row on int8
[17920, 1536]: 15.7 vs 23.6 us: the dot path converts and scales fewer values per thread). Q8 weights are dequantized in
registers; SwiGLU of a gate|up input (SILU_IN) and the bias are fused in, which removes
two small kernels per layer. Block sizes are tuned per shape on first use; K is a
compile-time constant (a handful of shapes per model; the K loop then has a fixed count).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

Q8_BLOCK = 32
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, stride_xm, K: tl.constexpr,
                 HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_IN: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    n64 = n.to(tl.int64)
    G: tl.constexpr = BLOCK_K // 32  # scale groups per K step
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        x_mask = m_mask[:, None] & k_mask[None, :]
        x_offs = m[:, None] * stride_xm + k[None, :]
        if SILU_IN:  # x is [gate | up]; torch rounds silu(gate) to the storage dtype first
            g = tl.load(x_ptr + x_offs, mask=x_mask, other=0.0).to(tl.float32)
            u = tl.load(x_ptr + x_offs + K, mask=x_mask, other=0.0).to(tl.float32)
            s = (g / (1.0 + tl.exp(-g))).to(x_ptr.dtype.element_ty).to(tl.float32)
            xt = (s * u).to(x_ptr.dtype.element_ty)
        else:
            xt = tl.load(x_ptr + x_offs, mask=x_mask, other=0.0)
        w_mask = n_mask[:, None] & k_mask[None, :]
        w = tl.load(w_ptr + n64[:, None] * K + k[None, :], mask=w_mask, other=0)
        if HAS_SCALE:
            grp = k0 // 32 + tl.arange(0, G)
            sc = tl.load(s_ptr + n64[:, None] * (K // 32) + grp[None, :],
                         mask=n_mask[:, None] & (grp < K // 32)[None, :], other=0.0).to(tl.float32)
            wf = tl.reshape(tl.reshape(w.to(tl.float32), [BLOCK_N, G, 32]) * sc[:, :, None], [BLOCK_N, BLOCK_K])
        else:
            wf = w.to(tl.float32)
        if BLOCK_M == 1:
            acc += tl.sum(xt.to(tl.float32)[:, None, :] * wf[None, :, :], axis=2)
        else:
            acc += tl.dot(xt, tl.trans(wf.to(xt.dtype)))
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    # round through the weights' activation dtype first, as F.linear(...).to(out) would
    tl.store(out_ptr + m[:, None] * N + n[None, :], acc.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty),
             mask=out_mask)


def _configs(block_m: int) -> list[triton.Config]:
    if block_m == 1:  # (BLOCK_N, BLOCK_K, warps): few columns per program keep 132 SMs busy at N=1536
        return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=nw)
                for bn, bk, nw in [(1, 2048, 4), (2, 1024, 4), (4, 1024, 4), (4, 2048, 8), (8, 512, 4),
                                   (16, 256, 4)]]
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=nw, num_stages=ns)
            for bn, bk, nw, ns in [(16, 128, 4, 4), (16, 256, 4, 3), (32, 128, 4, 4), (32, 256, 4, 3),
                                   (64, 128, 4, 3)]]


def _bench(fn: Callable[[], object], quantiles: list[float] | None = None) -> float | list[float]:
    """Shorter tuning runs than Triton's default (25 + 100 ms per config)."""
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


_TUNED = {bm: triton.autotune(_configs(bm), key=["N", "K", "HAS_SCALE", "SILU_IN"], do_bench=_bench)(_gemv_kernel)
          for bm in (1, 16)}
# Fixed blocks for the CPU interpreter (tests), which would run every config.
_FIXED = {1: {"BLOCK_N": 4, "BLOCK_K": 64}, 16: {"BLOCK_N": 16, "BLOCK_K": 64}}


def gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
         silu_input: bool, out_dtype: torch.dtype, fixed_blocks: bool = INTERPRET) -> torch.Tensor:
    """x [.., K] (or [.., 2K] gate|up when silu_input), w [N, K] int8 (with scale) or float -> [.., N].

    fixed_blocks skips tuning (the interpreter; tests of many small shapes)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n_rows = x2.shape[0]
    n_out, k = w.shape
    assert n_rows <= 16 and w.is_contiguous() and x2.shape[1] == (2 * k if silu_input else k)
    block_m = 1 if n_rows == 1 and n_out < 8192 else 16
    out = torch.empty((n_rows, n_out), dtype=out_dtype, device=x.device)
    args = (x2, w, scale if scale is not None else w, bias if bias is not None else w, out,
            n_rows, n_out, x2.stride(0), k)
    flags = {"HAS_SCALE": scale is not None, "HAS_BIAS": bias is not None, "SILU_IN": silu_input,
             "BLOCK_M": block_m}
    if fixed_blocks:
        cfg = _FIXED[block_m]
        _gemv_kernel[(triton.cdiv(n_out, cfg["BLOCK_N"]),)](*args, **flags, **cfg)
    else:
        _TUNED[block_m][lambda meta: (triton.cdiv(n_out, meta["BLOCK_N"]),)](*args, **flags)
    return out.view(*lead, n_out)


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, out_ptr, n_groups, BLOCK_G: tl.constexpr):
    g = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    g_mask = g < n_groups
    j = tl.arange(0, 32)
    offs = g.to(tl.int64)[:, None] * 32 + j[None, :]
    q = tl.load(q_ptr + offs, mask=g_mask[:, None], other=0).to(tl.float32)
    s = tl.load(s_ptr + g, mask=g_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (q * s[:, None]).to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One pass int8 -> dtype (prefill's path to cuBLAS)."""
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    n_groups = q.numel() // Q8_BLOCK
    _dequant_kernel[(triton.cdiv(n_groups, 64),)](q, scale, out, n_groups, BLOCK_G=64, num_warps=4)
    return out
