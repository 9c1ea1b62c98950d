"""Triton matrix-vector kernels for 1..16 rows: bit-packed quantized weights, or float weights.

Quantized (the fallback where the CUDA C kernels of quant_cuda.py cannot be built, and what the
CPU tests run under Triton's interpreter): `_gemv_quant_row_kernel` takes one row on CUDA cores,
summing sum((1 + u / 2^bits) x) per group with the bit fields read as floats by an exponent
trick; `_gemv_quant_dot_kernel` takes 1..16 rows on tensor cores, each bit field dequantized to
the activation dtype for its own dot. Both reach a small fraction of the memory bandwidth the
CUDA C kernels reach, hence those.

Float weights (`_gemv_float_kernel`): one row on CUDA cores with few columns per program so
every SM has work, wide matrices and more rows through a tensor-core dot; fixed blocks per
shape (`pick_float_blocks`). The kernels fuse SwiGLU of a gate|up input (SILU_IN) and the bias.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from specserve.kernels.quant_weight import QuantWeight

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
def _field(words, i: tl.constexpr, BITS: tl.constexpr):
    """Bit field i of int32 words as the fp32 value 1 + u / 2^BITS, exactly and with no conversion
    instruction: the field is moved to the top of the mantissa under 1.0's exponent."""
    TOP: tl.constexpr = 23 - BITS
    SHIFT: tl.constexpr = BITS * i - TOP
    t = words >> SHIFT if SHIFT >= 0 else words << -SHIFT
    return ((t & (((1 << BITS) - 1) << TOP)) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _scale_min(sm_ptr, offs, mask):
    """(scale, min) fp32 from their fp16 pair read as one int32."""
    sm = tl.load(sm_ptr + offs, mask=mask, other=0)
    s = (sm & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    mn = (sm >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return s, mn


@triton.jit
def _k_step(w_ptr, sm_ptr, rows, r_mask, k0, K: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
            BLOCK_K: tl.constexpr):
    """The NG = BLOCK_K / G groups of one K step from k0 of the packed weight rows `rows`: (group ids, their
    mask, words [rows, NG, WPG] (WPG = G * BITS / 32 words a group), scales and mins [rows, NG])."""
    WPG: tl.constexpr = G * BITS // 32
    NG: tl.constexpr = BLOCK_K // G
    grp = k0 // G + tl.arange(0, NG)
    g_mask = grp < K // G
    gofs = rows[:, None] * (K // G) + grp[None, :]
    gn_mask = r_mask[:, None] & g_mask[None, :]
    words = tl.load(w_ptr + gofs[:, :, None] * WPG + tl.arange(0, WPG)[None, None, :], mask=gn_mask[:, :, None],
                    other=0)
    s, mn = _scale_min(sm_ptr, gofs, gn_mask)
    return grp, g_mask, words, s, mn


@triton.jit
def row_products(x_ptr, w_ptr, sm_ptr, rows, r_mask, K: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
                  SILU_IN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One activation row at x_ptr ([K], or [gate | up] of 2K with SILU_IN) times the packed weight rows
    `rows` (int64 [BLOCK_N], rows of the stacked matrix) -> fp32 [BLOCK_N]. Per group:
    s * sum(u x) - min * sum(x), with sum(u x) = (sum((1 + u / 2^BITS) x) - sum(x)) * 2^BITS."""
    PER: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = G // PER
    NG: tl.constexpr = BLOCK_K // G
    j = tl.arange(0, WPG)
    acc = tl.zeros([BLOCK_N, NG], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        grp, g_mask, words, s, mn = _k_step(w_ptr, sm_ptr, rows, r_mask, k0, K, BITS, G, BLOCK_K)
        part = tl.zeros([BLOCK_N, NG, WPG], tl.float32)
        x_sum = tl.zeros([NG, WPG], tl.float32)
        for i in tl.static_range(PER):
            xi = _load_x(x_ptr, grp[:, None] * G + i * WPG + j[None, :], g_mask[:, None], K, SILU_IN).to(tl.float32)
            part += _field(words, i, BITS) * xi[None, :, :]
            x_sum += xi
        sx = tl.sum(x_sum, axis=1)[None, :]
        acc += s * ((tl.sum(part, axis=2) - sx) * (1 << BITS)) - mn * sx
    return tl.sum(acc, axis=1)


@triton.jit
def _gemv_quant_row_kernel(x_ptr, w_ptr, sm_ptr, b_ptr, out_ptr, N, K: tl.constexpr, BITS: tl.constexpr,
                           G: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_IN: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr):
    """One row on CUDA cores (`row_products`)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    y = row_products(x_ptr, w_ptr, sm_ptr, n.to(tl.int64), n_mask, K, BITS, G, SILU_IN, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + n, y.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def tile_products(x_ptr, x_offs, m_mask, w_ptr, sm_ptr, rows, n_mask, K: tl.constexpr, BITS: tl.constexpr,
                   G: tl.constexpr, SILU_IN: tl.constexpr, BM: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """BM activation rows (starting at x_ptr + x_offs, int64 [BM]) times the packed weight rows `rows`
    (int64 [BLOCK_N]) on tensor cores -> fp32 [BM, BLOCK_N]: each bit field of a K step is dequantized to
    the activation dtype and enters its own dot with the matching run of k."""
    acc = tl.zeros([BM, BLOCK_N], tl.float32)
    WPG: tl.constexpr = G * BITS // 32
    FIELD_K: tl.constexpr = BLOCK_K * BITS // 32  # the k one bit field position covers in a step
    j = tl.arange(0, WPG)
    for k0 in range(0, K, BLOCK_K):
        grp, g_mask, words, s, mn = _k_step(w_ptr, sm_ptr, rows, n_mask, k0, K, BITS, G, BLOCK_K)
        a = (s * (1 << BITS))[:, :, None]  # (1 + u / 2^BITS) * a - (a + min) = s * u - min
        c = a + mn[:, :, None]
        for i in tl.static_range(32 // BITS):
            w = (_field(words, i, BITS) * a - c).to(x_ptr.dtype.element_ty)
            xi = _load_x(x_ptr, x_offs[:, None, None] + grp[None, :, None] * G + i * WPG + j[None, None, :],
                         m_mask[:, None, None] & g_mask[None, :, None], K, SILU_IN)
            acc += tl.dot(tl.reshape(xi, [BM, FIELD_K]), tl.trans(tl.reshape(w, [BLOCK_N, FIELD_K])))
    return acc


@triton.jit
def _gemv_quant_dot_kernel(x_ptr, w_ptr, sm_ptr, b_ptr, out_ptr, M, N, stride_xm, K: tl.constexpr,
                           BITS: tl.constexpr, G: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_IN: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """1..16 rows on tensor cores (rows padded to 16, `tile_products`)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    m = tl.arange(0, 16)
    m_mask = m < M
    acc = tile_products(x_ptr, m.to(tl.int64) * stride_xm, m_mask, w_ptr, sm_ptr, n.to(tl.int64), n_mask, K, BITS,
                         G, SILU_IN, 16, BLOCK_N, BLOCK_K)
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
    are configs that a tuning run chose on an H200."""
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


def pick_quant_blocks(n_rows: int, n_out: int, k: int, bits: int) -> tuple[str, dict[str, int]]:
    """Which quantized kernel ("row": CUDA cores, one row; "dot": tensor cores) and its fixed blocks
    (from one H200 sweep; the CUDA C kernels are what run there)."""
    if INTERPRET:  # every program runs in Python: few, small ones
        return ("row", {"BLOCK_N": 4, "BLOCK_K": 64}) if n_rows == 1 else ("dot", {"BLOCK_N": 16, "BLOCK_K": 128})
    if n_rows == 1:
        return "row", {"BLOCK_N": 4 if k <= 4096 else 2, "BLOCK_K": 8192 // bits, "num_warps": 4}
    return "dot", {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}


def gemv(x: torch.Tensor, w: torch.Tensor | QuantWeight, bias: torch.Tensor | None, silu_input: bool,
         out_dtype: torch.dtype) -> torch.Tensor:
    """x [.., K] (or [.., 2K] gate|up when silu_input) times W [N, K]^T -> [.., N] in out_dtype."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n_rows = x2.shape[0]
    n_out, k = w.shape
    assert n_rows <= 16 and x2.shape[1] == (2 * k if silu_input else k)
    out = torch.empty((n_rows, n_out), dtype=out_dtype, device=x.device)
    b = bias if bias is not None else x2
    if isinstance(w, QuantWeight):
        kind, cfg = pick_quant_blocks(n_rows, n_out, k, w.bits)
        args = (x2, w.words, w.sm.view(torch.int32), b, out)
        flags = {"BITS": w.bits, "G": w.group, "HAS_BIAS": bias is not None, "SILU_IN": silu_input, **cfg}
        grid = (triton.cdiv(n_out, cfg["BLOCK_N"]),)
        if kind == "row":
            assert n_rows == 1
            _gemv_quant_row_kernel[grid](*args, n_out, k, **flags)
        else:
            _gemv_quant_dot_kernel[grid](*args, n_rows, n_out, x2.stride(0), k, **flags)
    else:
        assert w.is_contiguous()
        block_m, cfg = pick_float_blocks(n_rows, n_out, k)
        _gemv_float_kernel[(triton.cdiv(n_out, cfg["BLOCK_N"]),)](
            x2, w, b, out, n_rows, n_out, x2.stride(0), k, HAS_BIAS=bias is not None, SILU_IN=silu_input,
            BLOCK_M=block_m, **cfg)
    return out.view(*lead, n_out)


@triton.jit
def _dequant_kernel(w_ptr, sm_ptr, out_ptr, n_groups, BITS: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr):
    """scale * u - min of BLOCK_G groups: every bit field of every word at once, then each group's G
    values stored as one contiguous run (field i of word j is k = i * WPG + j)."""
    PER: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = G // PER
    grp = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    g_mask = grp < n_groups
    grp64 = grp.to(tl.int64)
    words = tl.load(w_ptr + grp64[:, None] * WPG + tl.arange(0, WPG)[None, :], mask=g_mask[:, None], other=0)
    shifts = tl.arange(0, PER)[None, :, None] * BITS
    u = (words[:, None, :] >> shifts) & ((1 << BITS) - 1)  # [BLOCK_G, PER, WPG]; the mask drops sign bits
    s, mn = _scale_min(sm_ptr, grp64, g_mask)
    vals = tl.reshape(u.to(tl.float32) * s[:, None, None] - mn[:, None, None], [BLOCK_G, G])
    tl.store(out_ptr + grp64[:, None] * G + tl.arange(0, G)[None, :], vals.to(out_ptr.dtype.element_ty),
             mask=g_mask[:, None])


def dequantize(w: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """One pass to `dtype` (prefill's path to cuBLAS)."""
    out = torch.empty(w.shape, dtype=dtype, device=w.words.device)
    n_groups = w.sm.shape[0] * w.sm.shape[1]
    block_g = 64 if INTERPRET else 128
    _dequant_kernel[(triton.cdiv(n_groups, block_g),)](w.words, w.sm.view(torch.int32), out, n_groups, BITS=w.bits,
                                                       G=w.group, BLOCK_G=block_g, num_warps=4)
    return out
