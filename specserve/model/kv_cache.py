"""Paged KV memory, device side: the pool every sequence's K/V rows live in, and the block tables the
attention kernels read (the host's accounting is kv_blocks.py / kv_ledger.py).

A pool (one for K, one for V) is [n_layers, n_blocks, n_kv_heads, block_size, row]: within a block each head's rows
are contiguous, so attention reads a head's keys in runs of a block rather than one row between the other
heads' (docs/perf.md has what that is worth on the CPU). A row's K/V goes to its slot: block
slot // block_size, offset slot % block_size. A sequence's keys are found through its table row [blocks a
sequence]. The device's table learns each block a step writes from that step's own rows
(`KVStep.note_rows`, inside the forward and so inside a CUDA graph): no separate upload on the step path.
Blocks a sequence gets without writing them (a shared prefix, a restored slot) are entered by `set_table`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.kernels.kv_format import COMPUTE, KVFormat
from specserve.model.kv_blocks import blocks_for


@dataclass(frozen=True)
class KVStep:
    """The KV cache as one step's layers see it."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, K and V [n_blocks, n_kv_heads, block_size, dim]
    table: torch.Tensor  # int32 [sequences, blocks a sequence]: pool block of each of a sequence's blocks
    slots: torch.Tensor  # long [rows]: the pool slot each row's K/V goes to
    # A step with token trees (Batch.tree_layout): per row, its rotary position (a tree node's is before the
    # position it is written at) and the 64 positions before it that it must not see (bit j: position - j).
    rope: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    prompt: bool = False  # the step reads prompt chunks (some rows want no logits): attention may tile their rows

    def rope_positions(self, positions: torch.Tensor) -> torch.Tensor:
        return positions if self.rope is None else self.rope

    def note_rows(self, positions: torch.Tensor, seq_ids: torch.Tensor) -> None:
        """Enter the block each row writes into its sequence's table (rows of one block agree)."""
        size = self.layers[0][0].shape[2]
        index = seq_ids * self.table.shape[1] + torch.div(positions, size, rounding_mode="floor")
        blocks = torch.div(self.slots, size, rounding_mode="floor").to(self.table.dtype)
        self.table.view(-1).index_copy_(0, index, blocks)


class PagedKV:
    """The pool and the block tables of one runner. With a scratch block (CUDA graphs), padding rows of a
    graph write to the last block through the last table row, which no sequence uses.

    K and V each have their own pool [n_layers, n_blocks, n_kv_heads, block_size, row width] in their own
    format (model/kv_format.py: `-ctk`, `-ctv`); a float format's row is head_dim values."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, *, n_blocks: int, n_seqs: int, n_ctx: int,
                 block_size: int, dtype: torch.dtype, device: torch.device, scratch: bool = False,
                 formats: tuple[KVFormat, KVFormat] = (COMPUTE, COMPUTE)):
        self.block_size = block_size
        self.head_dim = head_dim
        self.dtype = dtype  # what rows are read back as
        self.scratch_block = n_blocks
        self.formats = formats
        self.pools = [torch.zeros((n_layers, n_blocks + int(scratch), n_kv_heads, block_size, f.row_width(head_dim)),
                                  dtype=f.storage_dtype(dtype), device=device) for f in formats]
        self.table = torch.full((n_seqs + int(scratch), blocks_for(n_ctx, block_size)), n_blocks if scratch else 0,
                                dtype=torch.int32, device=device)
        k_pool, v_pool = self.pools
        self.layers = [(k_pool[i], v_pool[i]) for i in range(n_layers)]  # views made once, not per step

    @property
    def scratch_slot(self) -> int:
        return self.scratch_block * self.block_size

    @property
    def n_bytes(self) -> int:
        return sum(pool.numel() * pool.element_size() for pool in self.pools)

    def step(self, slots: torch.Tensor, tree: tuple[torch.Tensor, torch.Tensor] | None = None,
             prompt: bool = False) -> KVStep:
        """tree: (rotary positions, hidden bits) per row of a step with token trees; prompt: see KVStep."""
        rope, hidden = tree if tree is not None else (None, None)
        return KVStep(self.layers, self.table, slots, rope, hidden, prompt)

    def move_rows(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy the K/V of slots `src` to slots `dst`, every layer, as stored (a token tree's accepted path)."""
        if not src:
            return
        device = self.table.device
        size = self.block_size
        src_t, dst_t = (torch.tensor(s, dtype=torch.long).to(device) for s in (src, dst))
        for pool in self.pools:
            rows = pool[:, src_t // size, :, src_t % size]  # (a copy: the sources may overlap the destinations)
            pool[:, dst_t // size, :, dst_t % size] = rows

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy each (source, destination) block, every layer (copy on write; queued in stream order)."""
        if pairs:
            src, dst = (torch.tensor(ids).to(self.table.device) for ids in zip(*pairs, strict=True))
            for pool in self.pools:
                pool.index_copy_(1, dst, pool.index_select(1, src))

    def set_table(self, seq: int, blocks: Sequence[int]) -> None:
        if blocks:
            self.table[seq, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32).to(self.table.device)

    def _where(self, slots: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.tensor(list(slots), dtype=torch.long).to(self.table.device)
        return torch.div(index, self.block_size, rounding_mode="floor"), index % self.block_size

    def read(self, slots: Sequence[int]) -> torch.Tensor:
        """The rows at these slots on the CPU, as values: [n_layers, 2, n_kv_heads, len(slots), head_dim] (in the
        compute dtype; fp32 where a pool is packed, so they encode back to the same bytes)."""
        blocks, offsets = self._where(slots)
        dtype = torch.float32 if any(f.packed for f in self.formats) else self.dtype
        # indexing two dims apart puts the slots first: [n, n_layers, heads, row]
        rows = [f.decode(pool[:, blocks, :, offsets], self.head_dim, dtype).permute(1, 2, 0, 3)
                for f, pool in zip(self.formats, self.pools, strict=True)]
        return torch.stack(rows, dim=1).to("cpu", copy=True)

    def write(self, slots: Sequence[int], kv: torch.Tensor) -> None:
        """kv [n_layers, 2, n_kv_heads, len(slots), head_dim] into these slots."""
        blocks, offsets = self._where(slots)
        for i, (f, pool) in enumerate(zip(self.formats, self.pools, strict=True)):
            pool[:, blocks, :, offsets] = f.encode(kv[:, i].to(pool.device).permute(2, 0, 1, 3)).to(pool.dtype)
