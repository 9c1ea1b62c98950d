"""Triton attention over the slot-major KV cache, flash-decoding style.

Every query row carries its own (sequence, position), so one launch serves any mix of
decode rows and multi-token verify rows of many sequences, and the launch shape depends
only on the row count: CUDA graphs can capture it. The context is cut into fixed splits;
one program handles one (row, kv head, split) for all query heads of that kv head (GQA),
and the last of a row's splits to finish merges them by their log-sum-exp (a counter per
row and kv head), so a step costs one launch per layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # keys per inner step
MAX_SPLITS = 64


def split_len(ctx: int) -> int:
    """Context positions per program: short (64) so a decode step at small batch spreads over
    many programs (each one is latency-bound), longer only to keep at most MAX_SPLITS splits."""
    return max(BLOCK_N, triton.next_power_of_2(triton.cdiv(ctx, MAX_SPLITS)))


@triton.jit
def _attn_split_kernel(q_ptr, kc_ptr, vc_ptr, seq_ptr, pos_ptr, mid_o_ptr, mid_lse_ptr, count_ptr, out_ptr, scale,
                       stride_q_tok, stride_q_head, stride_c_seq, stride_c_head, stride_c_pos,
                       N_SPLITS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, N_HEADS: tl.constexpr,
                       N_KV: tl.constexpr, HEAD_DIM: tl.constexpr, SPLIT_LEN: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    pos = tl.load(pos_ptr + row)
    start = split * SPLIT_LEN
    if start <= pos:
        seq = tl.load(seq_ptr + row)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        heads = kv_head * GROUP + g
        g_mask = g < GROUP
        q = tl.load(q_ptr + row * stride_q_tok + heads[:, None] * stride_q_head + d[None, :],
                    mask=g_mask[:, None], other=0.0)
        base = seq * stride_c_seq + kv_head * stride_c_head
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        # A fixed trip count (masked past the row's position) keeps the loop shape static.
        for i in range(0, SPLIT_LEN // BLOCK):
            n = start + i * BLOCK + tl.arange(0, BLOCK)
            n_mask = n <= pos
            offs = base + n[:, None] * stride_c_pos + d[None, :]
            k = tl.load(kc_ptr + offs, mask=n_mask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            v = tl.load(vc_ptr + offs, mask=n_mask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        out_offs = (row * N_HEADS + heads)[:, None] * HEAD_DIM + d[None, :]
        n_valid = pos // SPLIT_LEN + 1  # splits holding positions 0..pos
        if n_valid == 1:
            tl.store(out_ptr + out_offs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
        else:
            mid = (row * N_HEADS + heads) * N_SPLITS + split
            tl.store(mid_o_ptr + mid[:, None] * HEAD_DIM + d[None, :], acc / l_i[:, None], mask=g_mask[:, None])
            tl.store(mid_lse_ptr + mid, m_i + tl.log(l_i), mask=g_mask)
            # The last split of this (row, kv head) to finish merges all of them by their log-sum-exp,
            # in split order (the same sums whichever program merges), and resets the counter for the
            # next launch: no second kernel.
            tl.debug_barrier()  # every thread's partial is written before the count says so
            counter = count_ptr + row * N_KV + kv_head
            if tl.atomic_add(counter, 1, sem="acq_rel") == n_valid - 1:
                first = (row * N_HEADS + heads) * N_SPLITS
                m_run = tl.full([GROUP_PAD], float("-inf"), tl.float32)
                w_run = tl.zeros([GROUP_PAD], tl.float32)
                o_run = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
                for j in range(0, N_SPLITS):  # a static trip count; splits past n_valid hold nothing
                    if j < n_valid:
                        # .cg: read other programs' partials from L2, never from a stale L1 line
                        lse = tl.load(mid_lse_ptr + first + j, mask=g_mask, other=0.0, cache_modifier=".cg")
                        o = tl.load(mid_o_ptr + (first + j)[:, None] * HEAD_DIM + d[None, :], mask=g_mask[:, None],
                                    other=0.0, cache_modifier=".cg")
                        m_new = tl.maximum(m_run, lse)
                        alpha = tl.exp(m_run - m_new)
                        w = tl.exp(lse - m_new)
                        o_run = o_run * alpha[:, None] + o * w[:, None]
                        w_run = w_run * alpha + w
                        m_run = m_new
                tl.store(out_ptr + out_offs, (o_run / w_run[:, None]).to(out_ptr.dtype.element_ty),
                         mask=g_mask[:, None])
                tl.store(counter, 0)


_counters: dict[torch.device, list[torch.Tensor]] = {}


def split_counters(n: int, device: torch.device) -> torch.Tensor:
    """Zeroed int32 counters (at least n), one per (row, kv head) of a launch; every launch leaves
    them zero. A larger set replaces a smaller one outside graph capture, and the old sets stay
    allocated, since captured graphs hold their addresses."""
    held = _counters.setdefault(device, [])
    if not held or held[-1].numel() < n:
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        assert not capturing, "attention counters must exist before capture"
        held.append(torch.zeros(max(n, 1024), dtype=torch.int32, device=device))
    return held[-1]


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
              seq_ids: torch.Tensor, scale: float) -> torch.Tensor:
    """q [N, H, D]; caches [n_seqs, Hkv, ctx, D] (one layer) -> out [N, H, D]."""
    n_rows, n_heads, head_dim = q.shape
    n_kv = k_cache.shape[1]
    group = n_heads // n_kv
    split = split_len(k_cache.shape[2])
    n_splits = triton.cdiv(k_cache.shape[2], split)
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    mid_o = torch.empty((n_rows, n_heads, n_splits, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((n_rows, n_heads, n_splits), dtype=torch.float32, device=q.device)
    out = torch.empty((n_rows, n_heads, head_dim), dtype=q.dtype, device=q.device)
    _attn_split_kernel[(n_rows, n_kv, n_splits)](
        q, k_cache, v_cache, seq_ids, positions, mid_o, mid_lse, split_counters(n_rows * n_kv, q.device), out, scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        N_SPLITS=n_splits, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        N_HEADS=n_heads, N_KV=n_kv, HEAD_DIM=head_dim, SPLIT_LEN=split, BLOCK=BLOCK_N, num_warps=4, num_stages=2,
    )
    return out
