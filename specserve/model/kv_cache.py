"""Paged KV memory, device side: the pool every sequence's K/V rows live in, and the block tables the
attention kernels read (the host's accounting is kv_blocks.py / kv_ledger.py).

The pool is [n_layers, 2 (K/V), n_slots, n_kv_heads, head_dim]: one slot per position of a block, so a row's
K/V is written at its slot (block * block_size + offset) and a sequence's keys are gathered through its table
row [blocks a sequence]. The device's table learns each block a step writes from that step's own rows
(`KVStep.note_rows`, inside the forward and so inside a CUDA graph): no separate upload on the step path.
Blocks a sequence gets without writing them (a shared prefix, a restored slot) are entered by `set_table`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.model.kv_blocks import blocks_for


@dataclass(frozen=True)
class KVStep:
    """The KV cache as one step's layers see it."""

    pool: torch.Tensor  # [n_layers, 2, n_slots, n_kv_heads, head_dim]
    table: torch.Tensor  # int32 [sequences, blocks a sequence]: pool block of each of a sequence's blocks
    block_size: int
    slots: torch.Tensor  # long [rows]: the pool slot each row's K/V goes to

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V caches, [n_slots, n_kv_heads, head_dim] each."""
        return self.pool[i, 0], self.pool[i, 1]

    def note_rows(self, positions: torch.Tensor, seq_ids: torch.Tensor) -> None:
        """Enter the block each row writes into its sequence's table (rows of one block agree)."""
        width = self.table.shape[1]
        index = seq_ids * width + torch.div(positions, self.block_size, rounding_mode="floor")
        blocks = torch.div(self.slots, self.block_size, rounding_mode="floor").to(self.table.dtype)
        self.table.view(-1).index_copy_(0, index, blocks)


class PagedKV:
    """The pool and the block tables of one runner. With a scratch block (CUDA graphs), padding rows of a
    graph write to the last block through the last table row, which no sequence uses."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, *, n_blocks: int, n_seqs: int, n_ctx: int,
                 block_size: int, dtype: torch.dtype, device: torch.device, scratch: bool = False):
        self.block_size = block_size
        self.scratch_block = n_blocks
        self.pool = torch.zeros((n_layers, 2, (n_blocks + int(scratch)) * block_size, n_kv_heads, head_dim),
                                dtype=dtype, device=device)
        self.table = torch.full((n_seqs + int(scratch), blocks_for(n_ctx, block_size)), n_blocks if scratch else 0,
                                dtype=torch.int32, device=device)

    @property
    def scratch_slot(self) -> int:
        return self.scratch_block * self.block_size

    @property
    def n_bytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    def step(self, slots: torch.Tensor) -> KVStep:
        return KVStep(self.pool, self.table, self.block_size, slots)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy each (source, destination) block's rows, every layer (copy on write; queued in stream order)."""
        if not pairs:
            return
        b = self.block_size
        src = torch.tensor([s * b + i for s, _ in pairs for i in range(b)]).to(self.pool.device)
        dst = torch.tensor([d * b + i for _, d in pairs for i in range(b)]).to(self.pool.device)
        self.pool.index_copy_(2, dst, self.pool.index_select(2, src))

    def set_table(self, seq: int, blocks: Sequence[int]) -> None:
        if blocks:
            self.table[seq, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32).to(self.table.device)

    def read(self, slots: Sequence[int]) -> torch.Tensor:
        """The rows at these slots on the CPU: [n_layers, 2, n_kv_heads, len(slots), head_dim]."""
        index = torch.tensor(list(slots), dtype=torch.long).to(self.pool.device)
        return self.pool.index_select(2, index).transpose(2, 3).to("cpu", copy=True)

    def write(self, slots: Sequence[int], kv: torch.Tensor) -> None:
        """kv [n_layers, 2, n_kv_heads, len(slots), head_dim] into these slots."""
        index = torch.tensor(list(slots), dtype=torch.long).to(self.pool.device)
        self.pool.index_copy_(2, index, kv.transpose(2, 3).to(self.pool.device, self.pool.dtype))
