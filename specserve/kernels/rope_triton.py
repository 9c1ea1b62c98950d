"""Triton RoPE fused with the KV-cache write: one program per (token, head).

Query heads are rotated into a new tensor; key heads are rotated and value heads copied straight into each
token's row of the paged cache (its slot's block and offset), so K and V make one trip through memory. With
QK_NORM each query and key head is first RMS-normalised over its own values (Qwen3's q_norm / k_norm), rounded
to the storage dtype as the separate rms_norm would, so those two norms cost no launches of their own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _head_norm(base, x1, x2, idx1, idx2, w_ptr, eps, HALF: tl.constexpr):
    """x1, x2 (one head's two halves, fp32) times weight / rms of the head, rounded to the head's dtype."""
    x = tl.load(base + tl.arange(0, 2 * HALF)).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / (2 * HALF) + eps)
    dtype = base.dtype.element_ty
    y1 = (x1 * rstd * tl.load(w_ptr + idx1).to(tl.float32)).to(dtype).to(tl.float32)
    y2 = (x2 * rstd * tl.load(w_ptr + idx2).to(tl.float32)).to(dtype).to(tl.float32)
    return y1, y2


@triton.jit
def _rope_cache_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_out_ptr, kc_ptr, vc_ptr,
                       qn_ptr, kn_ptr, eps,
                       stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                       stride_c_block, stride_c_head, KV_BLOCK: tl.constexpr,
                       N_HEADS: tl.constexpr, HALF: tl.constexpr, NEOX: tl.constexpr, QK_NORM: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pos = tl.load(pos_ptr + tok)
    i = tl.arange(0, HALF)
    if NEOX:
        idx1 = i
        idx2 = i + HALF
    else:
        idx1 = 2 * i
        idx2 = 2 * i + 1
    c = tl.load(cos_ptr + pos * HALF + i)
    s = tl.load(sin_ptr + pos * HALF + i)
    if head < N_HEADS:
        base = q_ptr + tok * stride_q_tok + head * stride_q_head
        x1 = tl.load(base + idx1).to(tl.float32)
        x2 = tl.load(base + idx2).to(tl.float32)
        if QK_NORM:
            x1, x2 = _head_norm(base, x1, x2, idx1, idx2, qn_ptr, eps, HALF)
        out = q_out_ptr + (tok * N_HEADS + head) * (2 * HALF)
        tl.store(out + idx1, (x1 * c - x2 * s).to(q_out_ptr.dtype.element_ty))
        tl.store(out + idx2, (x2 * c + x1 * s).to(q_out_ptr.dtype.element_ty))
    else:
        kv_head = head - N_HEADS
        slot = tl.load(slot_ptr + tok)
        dst = (slot // KV_BLOCK) * stride_c_block + kv_head * stride_c_head + (slot % KV_BLOCK) * (2 * HALF)
        base = k_ptr + tok * stride_k_tok + kv_head * stride_k_head
        x1 = tl.load(base + idx1).to(tl.float32)
        x2 = tl.load(base + idx2).to(tl.float32)
        if QK_NORM:
            x1, x2 = _head_norm(base, x1, x2, idx1, idx2, kn_ptr, eps, HALF)
        tl.store(kc_ptr + dst + idx1, (x1 * c - x2 * s).to(kc_ptr.dtype.element_ty))
        tl.store(kc_ptr + dst + idx2, (x2 * c + x1 * s).to(kc_ptr.dtype.element_ty))
        vbase = v_ptr + tok * stride_v_tok + kv_head * stride_v_head
        tl.store(vc_ptr + dst + idx1, tl.load(vbase + idx1))
        tl.store(vc_ptr + dst + idx2, tl.load(vbase + idx2))


def rope_and_cache(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
    positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, style: str,
    head_norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """head_norms: (q weight, k weight, eps) of the per-head RMSNorms applied before the rotation."""
    n_tok, n_heads, head_dim = q.shape
    n_kv = k.shape[1]
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1 and k_cache.stride(3) == 1
    assert k_cache.stride(2) == head_dim
    assert k_cache.stride() == v_cache.stride()
    q_out = torch.empty((n_tok, n_heads, head_dim), dtype=q.dtype, device=q.device)
    _rope_cache_kernel[(n_tok, n_heads + n_kv)](
        q, k, v, cos_table, sin_table, positions, slots, q_out, k_cache, v_cache,
        *(head_norms if head_norms is not None else (q, q, 0.0)),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.shape[2],
        N_HEADS=n_heads, HALF=head_dim // 2, NEOX=style == "neox", QK_NORM=head_norms is not None, num_warps=1,
    )
    return q_out
