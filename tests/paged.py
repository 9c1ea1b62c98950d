"""Random paged KV caches for the kernel tests: sequences' blocks scattered over the pool, with the dense
[n_seqs, n_kv_heads, ctx, head_dim] view beside them to check against."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PagedCache:
    k: torch.Tensor  # [n_blocks, n_kv, block_size, dim]
    v: torch.Tensor
    table: torch.Tensor  # int32 [n_seqs, blocks a sequence]
    dense_k: torch.Tensor  # [n_seqs, n_kv, blocks * block_size, dim]
    dense_v: torch.Tensor


def paged_cache(n_seqs: int, n_kv: int, ctx: int, dim: int, gen: torch.Generator, block_size: int = 16,
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> PagedCache:
    """Random K/V of n_seqs sequences of ctx positions, their blocks in a shuffled order (and one spare block)."""
    n_blocks = -(-ctx // block_size)
    table = torch.randperm(n_seqs * n_blocks + 1, generator=gen)[: n_seqs * n_blocks].view(n_seqs, n_blocks)
    dense = [torch.randn(n_seqs, n_kv, n_blocks * block_size, dim, generator=gen) for _ in range(2)]
    pools = [torch.zeros(n_seqs * n_blocks + 1, n_kv, block_size, dim) for _ in range(2)]
    for s in range(n_seqs):
        for b in range(n_blocks):
            for pool, d in zip(pools, dense, strict=True):
                pool[int(table[s, b])] = d[s, :, b * block_size:(b + 1) * block_size]
    k, v = (p.to(device, dtype) for p in pools)
    return PagedCache(k, v, table.int().to(device), *(d.to(device, dtype) for d in dense))


def dense_attention(q: torch.Tensor, cache: PagedCache, positions: torch.Tensor, seq_ids: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Each row of q [N, H, d] over its sequence's dense cache, positions 0..its own (fp32, row by row)."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for r in range(q.shape[0]):
        s, p = int(seq_ids[r]), int(positions[r])
        k, v = cache.dense_k[s, :, : p + 1].float(), cache.dense_v[s, :, : p + 1].float()
        o = F.scaled_dot_product_attention(q[r : r + 1].float().transpose(0, 1).unsqueeze(0), k.unsqueeze(0),
                                           v.unsqueeze(0), scale=scale, enable_gqa=True)
        out[r] = o[0].transpose(0, 1)[0]
    return out
