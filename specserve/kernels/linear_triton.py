"""Triton matrix-vector kernel for 1..16 rows over group-quantized int8 or bf16 weights.

One program owns BLOCK_N output columns and BLOCK_M rows and walks all of K, so each weight
is read from memory once per step. Multiply-adds run on CUDA cores into a register tile
that is reduced once at the end (no reductions inside the loop). Quantized weights are
turned into floats with the exponent trick (int + 0x4B000080 read as fp32, minus 2^23 + 128)
instead of an int-to-float conversion, which Hopper issues at 1/8 of the FMA rate and which
made an earlier version of this kernel conversion-bound. SwiGLU of a gate|up input
(SILU_IN) and the bias are fused in. Block sizes come from `pick_blocks`, a table measured
on an H200 (benchmarks/gemv_sweep.py); K and the group size are compile-time constants.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from specserve.kernels.linear import QuantWeight

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, mn_ptr, b_ptr, out_ptr, M, N, stride_xm, K: tl.constexpr,
                 G: tl.constexpr, QUANT: tl.constexpr, HAS_MIN: tl.constexpr, HAS_BIAS: tl.constexpr,
                 SILU_IN: tl.constexpr, MAGIC: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    NG: tl.constexpr = BLOCK_K // G  # groups per K step; tiles are [.., NG, G] so a group's scale broadcasts
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    n64 = n.to(tl.int64)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < M
    g = tl.arange(0, NG)
    j = tl.arange(0, G)
    acc = tl.zeros([BLOCK_M, BLOCK_N, NG, G], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + g[:, None] * G + j[None, :]
        k_mask = k < K
        x_offs = m[:, None, None] * stride_xm + k[None, :, :]
        x_mask = m_mask[:, None, None] & k_mask[None, :, :]
        if SILU_IN:  # x is [gate | up]; torch rounds silu(gate) to the storage dtype first
            gate = tl.load(x_ptr + x_offs, mask=x_mask, other=0.0).to(tl.float32)
            up = tl.load(x_ptr + x_offs + K, mask=x_mask, other=0.0).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
            xt = (act * up).to(x_ptr.dtype.element_ty).to(tl.float32)
        else:
            xt = tl.load(x_ptr + x_offs, mask=x_mask, other=0.0).to(tl.float32)
        w_mask = n_mask[:, None, None] & k_mask[None, :, :]
        w = tl.load(w_ptr + n64[:, None, None] * K + k[None, :, :], mask=w_mask, other=0)
        if QUANT:
            # MAGIC, exact for int8: 2^23 + 128 + q has q + 128 in its low mantissa bits
            wf = ((w.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0) if MAGIC \
                else w.to(tl.float32)
            grp = k0 // G + g
            s_offs = n64[:, None] * (K // G) + grp[None, :]
            s_mask = n_mask[:, None] & (grp < K // G)[None, :]
            wf = wf * tl.load(s_ptr + s_offs, mask=s_mask, other=0.0)[:, :, None]
            if HAS_MIN:
                wf = wf - tl.load(mn_ptr + s_offs, mask=s_mask, other=0.0)[:, :, None]
        else:
            wf = w.to(tl.float32)
        acc += xt[:, None, :, :] * wf[None, :, :, :]
    y = tl.sum(tl.sum(acc, axis=3), axis=2)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    # round through the activation dtype first, as F.linear(...).to(out) would
    tl.store(out_ptr + m[:, None] * N + n[None, :], y.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty),
             mask=out_mask)


def pick_blocks(rows: int, n_out: int, k: int) -> dict[str, int]:
    """BLOCK_M/N/K and warps: a row tile of the next power of two, and per-thread work kept near
    16 weights x rows (the accumulator lives in registers). Few output columns get narrow
    column tiles so that every SM has programs."""
    block_m = min(16, triton.next_power_of_2(rows))
    if INTERPRET:
        return {"BLOCK_M": block_m, "BLOCK_N": 4, "BLOCK_K": 64, "num_warps": 4}
    tile = 2048 // block_m * 4 if block_m < 4 else 2048 // block_m * 2
    block_n = 2 if n_out <= 4096 else 4
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": max(32, tile // block_n), "num_warps": 4}


def gemv(x: torch.Tensor, w: torch.Tensor | QuantWeight, bias: torch.Tensor | None, silu_input: bool,
         out_dtype: torch.dtype, blocks: dict[str, int] | None = None, magic: bool = True) -> torch.Tensor:
    """x [.., K] (or [.., 2K] gate|up when silu_input) times W [N, K]^T -> [.., N] in out_dtype.

    `blocks` overrides pick_blocks (the sweep benchmark); magic=False uses plain int->float."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n_rows = x2.shape[0]
    quant = isinstance(w, QuantWeight)
    q = w.q if quant else w
    n_out, k = q.shape
    group = w.group if quant else 32
    assert n_rows <= 16 and q.is_contiguous() and x2.shape[1] == (2 * k if silu_input else k)
    cfg = dict(blocks or pick_blocks(n_rows, n_out, k))
    cfg["BLOCK_K"] = max(cfg["BLOCK_K"], group)
    out = torch.empty((n_rows, n_out), dtype=out_dtype, device=x.device)
    scale = w.scale if quant else q
    mins = w.min if quant and w.min is not None else scale
    grid = (triton.cdiv(n_out, cfg["BLOCK_N"]), triton.cdiv(n_rows, cfg["BLOCK_M"]))
    _gemv_kernel[grid](x2, q, scale, mins, bias if bias is not None else q, out, n_rows, n_out, x2.stride(0), k,
                       G=group, QUANT=quant, HAS_MIN=quant and w.min is not None, HAS_BIAS=bias is not None,
                       SILU_IN=silu_input, MAGIC=magic, **cfg)
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
