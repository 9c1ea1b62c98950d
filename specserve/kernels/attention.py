"""Attention of new query rows over a paged KV cache (torch reference).

One layer's cache is [n_blocks, n_kv_heads, block_size, row] (model/kv_cache.py; a row is head_dim values or
a packed q8_0/q4_0 row, kernels/kv_format.py): position p of sequence s
sits in block table[s, p // block_size] at offset p % block_size. Each query row belongs to a sequence and a
position and attends to that sequence's positions 0..position (a token tree's rows: less, `hidden`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.kernels.kv_format import format_of


def sequence_kv(cache: torch.Tensor, table: torch.Tensor, seq: int, n: int, head_dim: int,
                dtype: torch.dtype) -> torch.Tensor:
    """Positions 0..n-1 of a sequence, gathered from its blocks and decoded: [n_kv_heads, n, head_dim]."""
    size = cache.shape[2]
    blocks = cache[table[seq, :-(-n // size)].long()]  # [blocks, heads, size, row]
    rows = blocks.transpose(0, 1).flatten(1, 2)[:, :n]
    return format_of(cache, head_dim).decode(rows, head_dim, dtype)


def attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                  table: torch.Tensor, runs: list[tuple[int, int, int, int]], scale: float,
                  hidden: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, n_heads, d] -> out [N, n_heads, d].

    runs: (seq, start_row, end_row, kv_len) for each block of consecutive rows of one
    sequence, kv_len = highest position in the block + 1 (known on the host, so no sync).
    hidden: int64 [N] or None; bit j of a row's word hides position (its position - j) from it (a token tree's
    rows see only their own branch, model/token_tree.py).
    """
    out = torch.empty_like(q)
    for seq, start, end, kv_len in runs:
        qs = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, T, d]
        k = sequence_kv(k_cache, table, seq, kv_len, q.shape[-1], q.dtype).unsqueeze(0)  # [1, Hkv, L, d]
        v = sequence_kv(v_cache, table, seq, kv_len, q.shape[-1], q.dtype).unsqueeze(0)
        pos = positions[start:end]
        back = pos[:, None] - torch.arange(kv_len, device=q.device)[None, :]  # [T, L]: how far each key lies back
        mask = back >= 0
        if hidden is not None:
            bits = hidden[start:end, None] >> back.clamp(0, 63) & 1
            mask &= (back > 63) | (bits == 0)
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = o.squeeze(0).transpose(0, 1)
    return out
