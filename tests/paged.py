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


@dataclass
class TreeRows:
    """A token tree's rows on sequence 0 (model/token_tree.py) and a plain row of sequence 1, with their dense
    reference: each tree row sees the cache before the tree and its own ancestors only."""

    positions: torch.Tensor
    seq_ids: torch.Tensor
    hidden: torch.Tensor
    runs: list[tuple[int, int, int, int]]
    expected: torch.Tensor  # [rows, n_heads, dim], fp32


def tree_rows(cache: PagedCache, q: torch.Tensor, start: int, parents: list[int], plain_position: int,
              scale: float) -> TreeRows:
    """q's first len(parents) rows are the tree's nodes at positions start.. of sequence 0, its last row a plain
    row of sequence 1."""
    n = len(parents)
    seen = []
    for i, p in enumerate(parents):
        seen.append((seen[p] if p >= 0 else set()) | {i})
    hidden = [sum(1 << (i - j) for j in range(i) if j not in s) for i, s in enumerate(seen)] + [0]
    positions = [start + i for i in range(n)] + [plain_position]
    seq_ids = [0] * n + [1]
    expected = torch.empty(q.shape, dtype=torch.float32)
    for r in range(n + 1):
        keys = list(range(start)) + [start + j for j in sorted(seen[r])] if r < n else list(range(plain_position + 1))
        k = cache.dense_k[seq_ids[r], :, keys].float().cpu()
        v = cache.dense_v[seq_ids[r], :, keys].float().cpu()
        o = F.scaled_dot_product_attention(q[r:r + 1].float().cpu().transpose(0, 1).unsqueeze(0), k.unsqueeze(0),
                                           v.unsqueeze(0), scale=scale, enable_gqa=True)
        expected[r] = o[0].transpose(0, 1)[0]
    device = q.device
    return TreeRows(torch.tensor(positions, device=device), torch.tensor(seq_ids, device=device),
                    torch.tensor(hidden, device=device), [(0, 0, n, start + n), (1, n, n + 1, plain_position + 1)],
                    expected)
