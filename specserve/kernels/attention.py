"""Attention of new query rows over a slot-major KV cache (torch reference).

The cache of one layer is [n_seqs, n_kv_heads, ctx, head_dim]; each query row belongs to
a sequence and a position and attends to that sequence's cache positions 0..position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    runs: list[tuple[int, int, int, int]],
    scale: float,
) -> torch.Tensor:
    """q [N, n_heads, d] -> out [N, n_heads, d].

    runs: (seq, start_row, end_row, kv_len) for each block of consecutive rows of one
    sequence, kv_len = highest position in the block + 1 (known on the host, so no sync).
    """
    out = torch.empty_like(q)
    for seq, start, end, kv_len in runs:
        qs = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, T, d]
        k = k_cache[seq, :, :kv_len].unsqueeze(0)  # [1, Hkv, L, d]
        v = v_cache[seq, :, :kv_len].unsqueeze(0)
        pos = positions[start:end]
        mask = torch.arange(kv_len, device=q.device)[None, :] <= pos[:, None]  # [T, L]
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = o.squeeze(0).transpose(0, 1)
    return out
