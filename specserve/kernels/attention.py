"""Attention of new query rows over a paged KV cache (torch reference).

One layer's cache is [n_slots, n_kv_heads, head_dim] (model/kv_cache.py): position p of sequence s sits at slot
table[s, p // block_size] * block_size + p % block_size. Each query row belongs to a sequence and a position and
attends to that sequence's positions 0..position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.kernels import cpu_ops
from specserve.kernels.dispatch import triton_enabled


def sequence_slots(table: torch.Tensor, seq: int, n: int, block_size: int) -> torch.Tensor:
    """The pool slots of positions 0..n-1 of a sequence (long, on the table's device)."""
    blocks = table[seq, :-(-n // block_size)].long()
    offsets = torch.arange(block_size, device=table.device)
    return (blocks[:, None] * block_size + offsets).flatten()[:n]


def attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                  seq_ids: torch.Tensor, table: torch.Tensor, block_size: int,
                  runs: list[tuple[int, int, int, int]], scale: float) -> torch.Tensor:
    """q [N, n_heads, d] -> out [N, n_heads, d].

    runs: (seq, start_row, end_row, kv_len) for each block of consecutive rows of one
    sequence, kv_len = highest position in the block + 1 (known on the host, so no sync).
    """
    out = torch.empty_like(q)
    for seq, start, end, kv_len in runs:
        qs = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, T, d]
        slots = sequence_slots(table, seq, kv_len, block_size)
        k = k_cache[slots].transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, d]
        v = v_cache[slots].transpose(0, 1).unsqueeze(0)
        pos = positions[start:end]
        mask = torch.arange(kv_len, device=q.device)[None, :] <= pos[:, None]  # [T, L]
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = o.squeeze(0).transpose(0, 1)
    return out


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
              seq_ids: torch.Tensor, table: torch.Tensor, block_size: int,
              runs: list[tuple[int, int, int, int]], scale: float) -> torch.Tensor:
    """Dispatch: the Triton kernel reads (seq, position) per row on the device and ignores
    `runs`, so its launch does not depend on host-side batch layout (graph-capturable)."""
    if triton_enabled(q) and q.shape[-1] in (64, 128, 256):
        from specserve.kernels import attention_triton

        return attention_triton.attention(q, k_cache, v_cache, positions, seq_ids, table, block_size, scale)
    if cpu_ops.attention_takes(q, k_cache, v_cache, positions, seq_ids, table):
        return cpu_ops.attention(q, k_cache, v_cache, positions, seq_ids, table, block_size, scale)
    return attention_ref(q, k_cache, v_cache, positions, seq_ids, table, block_size, runs, scale)
