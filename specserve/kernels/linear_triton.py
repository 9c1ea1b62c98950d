"""Triton matrix-vector kernels for 1..16 rows: group-quantized int8 weights, or float weights.

Quantized (`_gemv_quant_kernel`): tensor cores for any row count, the rows padded to 16, so
a verify step of 8 rows costs what a decode step costs. Each K step takes NG groups at once
as a batched dot [NG, 16, G] x [NG, G, BLOCK_N]; the per-group scale (and min) is applied to
the group's partial sums, so the weights enter the dot as exact small integers. Integers in
[-64, 63] (every 4-, 5- and 6-bit GGUF format) become bf16 with no conversion instruction:
0x4340 + q read as bf16 is 192 + q, and the 192 * sum(x) this adds is taken out with the
min. Conversions run at 1/8 of the FMA rate on Hopper. Correct, but on an H200 still 2-5x
slower than the bf16 path per matrix (latency-bound K loops; benchmarks/results/kernel_notes.md
v3), which is why quantized weights are an option and not the default.

Float weights (`_gemv_float_kernel`): one row on CUDA cores with few columns per program so
every SM has work, wide matrices and more rows through a tensor-core dot; fixed blocks per
shape (`pick_float_blocks`). Both kernels fuse SwiGLU of a gate|up input (SILU_IN) and the bias.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from specserve.kernels.linear import QuantWeight

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _load_x(x_ptr, offs, mask, K: tl.constexpr, SILU_IN: tl.constexpr):
    """Activations at offs in their storage dtype; SILU_IN: silu(gate) * up of a [gate | up] row,
    rounded to the storage dtype at each step as torch does."""
    if SILU_IN:
        gate = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + offs + K, mask=mask, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
        return (act * up).to(x_ptr.dtype.element_ty)
    return tl.load(x_ptr + offs, mask=mask, other=0.0)


@triton.jit
def _gemv_quant_kernel(x_ptr, q_ptr, s_ptr, mn_ptr, b_ptr, out_ptr, M, N, stride_xm, K: tl.constexpr,
                       G: tl.constexpr, HAS_MIN: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_IN: tl.constexpr,
                       SMALL_Q: tl.constexpr, BLOCK_N: tl.constexpr, NG: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    n64 = n.to(tl.int64)
    m = tl.arange(0, 16)
    m_mask = m < M
    g = tl.arange(0, NG)
    j = tl.arange(0, G)
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    for k0 in range(0, K, NG * G):
        grp = k0 // G + g
        g_mask = grp < K // G
        x = _load_x(x_ptr, m[None, :, None] * stride_xm + grp[:, None, None] * G + j[None, None, :],
                    g_mask[:, None, None] & m_mask[None, :, None], K, SILU_IN)  # [NG, 16, G]
        gn_mask = g_mask[:, None, None] & n_mask[None, None, :]
        q = tl.load(q_ptr + n64[None, None, :] * K + grp[:, None, None] * G + j[None, :, None], mask=gn_mask,
                    other=0)  # [NG, G, BLOCK_N]
        # SMALL_Q: 0x4340 + q read as bf16 is 192 + q, exactly
        qb = (q.to(tl.int16) + 0x4340).to(tl.bfloat16, bitcast=True).to(x.dtype) if SMALL_Q else q.to(x.dtype)
        part = tl.dot(x, qb)  # [NG, 16, BLOCK_N], fp32
        s_offs = n64[None, None, :] * (K // G) + grp[:, None, None]  # [NG, 1, BLOCK_N]
        s = tl.load(s_ptr + s_offs, mask=gn_mask, other=0.0)
        c = 192.0 * s if SMALL_Q else tl.zeros_like(s)  # what the offset of qb adds per unit of sum(x)
        if HAS_MIN:
            c += tl.load(mn_ptr + s_offs, mask=gn_mask, other=0.0)
        x_sum = tl.sum(x.to(tl.float32), axis=2)[:, :, None]  # [NG, 16, 1]
        acc += tl.sum(part * s - x_sum * c, axis=0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    # round through the activation dtype first, as F.linear(...).to(out) would
    tl.store(out_ptr + m[:, None] * N + n[None, :], acc.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _gemv_float_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, stride_xm, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                       SILU_IN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    n64 = n.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        xt = _load_x(x_ptr, m[:, None] * stride_xm + k[None, :], m_mask[:, None] & k_mask[None, :], K, SILU_IN)
        w = tl.load(w_ptr + n64[:, None] * K + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if BLOCK_M == 1:
            acc += tl.sum(xt.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        else:
            acc += tl.dot(xt, tl.trans(w.to(xt.dtype)))
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None] * N + n[None, :], acc.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def pick_float_blocks(n_rows: int, n_out: int, k: int) -> tuple[int, dict[str, int]]:
    """BLOCK_M and fixed blocks for the float kernel. Fixed, not timed at start-up: timing-based
    tuning picked different blocks on different runs (wo: 1x2048 or 4x2048), hence other
    summation orders, and greedy text could change between restarts at bf16 near-ties. These
    are configs that tuning chose on an H200 (kernel_bench_v2.json)."""
    cuda_cores = n_rows == 1 and n_out < 8192
    if INTERPRET:  # the interpreter runs every program in Python: few, small ones
        return (1 if cuda_cores else 16), {"BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4}
    if cuda_cores:  # few columns per program so that every SM has work
        return 1, ({"BLOCK_N": 4, "BLOCK_K": 2048, "num_warps": 8} if k > 4096 else
                   {"BLOCK_N": 1, "BLOCK_K": 2048, "num_warps": 4})
    # tensor-core dot with the rows padded to 16
    if n_out > 65536:
        return 16, {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}
    if n_out >= 8192:
        return 16, {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
    return 16, {"BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}


def pick_quant_blocks(n_out: int, k: int, group: int) -> dict[str, int]:
    """BLOCK_N, groups per K step (NG), warps and stages for the quantized kernel (H200 sweep:
    benchmarks/kernel_bench.py --sections matrices)."""
    if INTERPRET:
        return {"BLOCK_N": 16, "NG": 2, "num_warps": 4}
    return {"BLOCK_N": 32 if n_out > 4096 else 16, "NG": 256 // group, "num_warps": 4, "num_stages": 3}


def gemv(x: torch.Tensor, w: torch.Tensor | QuantWeight, bias: torch.Tensor | None, silu_input: bool,
         out_dtype: torch.dtype, blocks: dict[str, int] | None = None) -> torch.Tensor:
    """x [.., K] (or [.., 2K] gate|up when silu_input) times W [N, K]^T -> [.., N] in out_dtype.

    `blocks` overrides the quantized kernel's block choice (the sweep benchmark)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n_rows = x2.shape[0]
    quant = isinstance(w, QuantWeight)
    n_out, k = w.shape
    assert n_rows <= 16 and x2.shape[1] == (2 * k if silu_input else k)
    out = torch.empty((n_rows, n_out), dtype=out_dtype, device=x.device)
    b = bias if bias is not None else x2
    if quant:
        cfg = blocks or pick_quant_blocks(n_out, k, w.group)
        mins = w.min if w.min is not None else w.scale
        _gemv_quant_kernel[(triton.cdiv(n_out, cfg["BLOCK_N"]),)](
            x2, w.q, w.scale, mins, b, out, n_rows, n_out, x2.stride(0), k, G=w.group, HAS_MIN=w.min is not None,
            HAS_BIAS=bias is not None, SILU_IN=silu_input, SMALL_Q=w.small, **cfg)
    else:
        assert w.is_contiguous()
        block_m, cfg = pick_float_blocks(n_rows, n_out, k)
        _gemv_float_kernel[(triton.cdiv(n_out, cfg["BLOCK_N"]),)](
            x2, w, b, out, n_rows, n_out, x2.stride(0), k, HAS_BIAS=bias is not None, SILU_IN=silu_input,
            BLOCK_M=block_m, **cfg)
    return out.view(*lead, n_out)


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, mn_ptr, out_ptr, n_groups, G: tl.constexpr, HAS_MIN: tl.constexpr,
                    BLOCK_G: tl.constexpr):
    grp = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    g_mask = grp < n_groups
    offs = grp.to(tl.int64)[:, None] * G + tl.arange(0, G)[None, :]
    w = tl.load(q_ptr + offs, mask=g_mask[:, None], other=0).to(tl.float32)
    w = w * tl.load(s_ptr + grp, mask=g_mask, other=0.0)[:, None]
    if HAS_MIN:
        w = w - tl.load(mn_ptr + grp, mask=g_mask, other=0.0)[:, None]
    tl.store(out_ptr + offs, w.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


def dequantize(w: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """One pass int8 -> dtype (prefill's path to cuBLAS)."""
    out = torch.empty(w.q.shape, dtype=dtype, device=w.q.device)
    n_groups = w.q.numel() // w.group
    block_g = 2048 // w.group
    _dequant_kernel[(triton.cdiv(n_groups, block_g),)](w.q, w.scale, w.min if w.min is not None else w.scale, out,
                                                       n_groups, G=w.group, HAS_MIN=w.min is not None,
                                                       BLOCK_G=block_g, num_warps=4)
    return out
