"""Triton: rows of K or V encoded into a packed q8_0 / q4_0 cache (kernels/kv_format.py) at their pool slots, one
program per (token, kv head), rounding as KVFormat.encode does (the scale rounded to fp16 first; q8_0 codes to the
nearest, ties to even through libdevice's rint; q4_0 floor(x / scale + 8.5)). rope.rope_and_cache runs the RoPE
kernel into a staging tensor and then this: two launches a layer instead of the reference's dozen small ops."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from specserve.kernels.kv_format import GROUP, format_of


@triton.jit
def _scales(x, BITS: tl.constexpr):
    """x [groups, 32] fp32 -> (fp16 scales [groups], fp32 1/scale, 0 where the scale is)."""
    if BITS == 8:
        scale = (tl.max(tl.abs(x), axis=1) / 127.0).to(tl.float16)
    else:  # the value of largest magnitude (the first of equals) maps to -8
        at = tl.argmax(tl.abs(x), axis=1, tie_break_left=True)
        picked = tl.sum(tl.where(tl.arange(0, 32)[None, :] == at[:, None], x, 0.0), axis=1)
        scale = (picked / -8.0 + 0.0).to(tl.float16)
    s = scale.to(tl.float32)
    # (`/` on fp32 is IEEE division, as torch's; tl.fdiv would be the approximate one)
    return scale, tl.where(s == 0.0, 0.0, 1.0 / tl.where(s == 0.0, 1.0, s))


@triton.jit
def _pack_kernel(src_ptr, slot_ptr, dst_ptr, stride_s_tok, stride_s_head, stride_d_block, stride_d_head,
                 KV_BLOCK: tl.constexpr, ROW: tl.constexpr, HEAD_DIM: tl.constexpr, BITS: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + tok)
    dst = dst_ptr + (slot // KV_BLOCK) * stride_d_block + head * stride_d_head + (slot % KV_BLOCK) * ROW
    src = src_ptr + tok * stride_s_tok + head * stride_s_head
    i = tl.arange(0, 32)
    if BITS == 8:
        g = tl.arange(0, HEAD_DIM // 32)
        x = tl.load(src + g[:, None] * 32 + i[None, :]).to(tl.float32)
        scale, inv = _scales(x, 8)
        codes = tl.minimum(tl.maximum(libdevice.rint(x * inv[:, None]), -127.0), 127.0)
        tl.store((dst + g[:, None] * 32 + i[None, :]).to(tl.pointer_type(tl.int8)), codes.to(tl.int8))
        tl.store((dst + HEAD_DIM + g * 2).to(tl.pointer_type(tl.float16)), scale)
    else:  # byte j: value j in the low nibble, value j + HEAD_DIM / 2 in the high one
        h = tl.arange(0, HEAD_DIM // 64)
        lo = tl.load(src + h[:, None] * 32 + i[None, :]).to(tl.float32)
        hi = tl.load(src + HEAD_DIM // 2 + h[:, None] * 32 + i[None, :]).to(tl.float32)
        lo_scale, lo_inv = _scales(lo, 4)
        hi_scale, hi_inv = _scales(hi, 4)
        lo_code = tl.minimum(tl.maximum(tl.floor(lo * lo_inv[:, None] + 8.5), 0.0), 15.0).to(tl.int32)
        hi_code = tl.minimum(tl.maximum(tl.floor(hi * hi_inv[:, None] + 8.5), 0.0), 15.0).to(tl.int32)
        tl.store(dst + h[:, None] * 32 + i[None, :], (lo_code | (hi_code << 4)).to(tl.uint8))
        scales = (dst + HEAD_DIM // 2 + h * 2).to(tl.pointer_type(tl.float16))
        tl.store(scales, lo_scale)
        tl.store(scales + HEAD_DIM // 64, hi_scale)


def takes(head_dim: int) -> bool:
    """Head sizes whose groups split evenly between a q4_0 row's halves, in a power-of-two count."""
    groups = head_dim // (2 * GROUP)
    return head_dim % (2 * GROUP) == 0 and groups & (groups - 1) == 0


def pack_rows(rows: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor) -> None:
    """rows [tokens, kv heads, head_dim] (any float dtype, unit stride in the last dim) into a packed layer cache
    [blocks, kv heads, block size, row] at each token's slot."""
    n_tok, n_kv, head_dim = rows.shape
    assert rows.stride(2) == 1 and cache.stride(3) == 1 and cache.stride(2) == cache.shape[3]
    _pack_kernel[(n_tok, n_kv)](rows, slots, cache, rows.stride(0), rows.stride(1), cache.stride(0), cache.stride(1),
                                KV_BLOCK=cache.shape[2], ROW=cache.shape[3], HEAD_DIM=head_dim,
                                BITS=format_of(cache, head_dim).code_bits, num_warps=1)
