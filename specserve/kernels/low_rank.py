"""Low-rank additions to a product (LoRA adapters), each row of a step with its own adapter scales.

A matrix W of the model may carry `LowRank`: the A and B matrices of every loaded adapter for it, stacked, so
one step's product with all adapters is two small matrix products whatever the count: y = x W^T plus
((x A^T) * s) B^T, where s [rows, R] is each row's scale for the adapter that owns each rank column
(`ResidualStream.adapter_scales`), and B carries each adapter's alpha / rank. A row whose scales are all 0 gets
exactly W's product plus zero. Fused matrices ([q | k | v], [gate | up]) take each part's adapter in its block of B.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LowRank:
    a: torch.Tensor  # [R, in]: every adapter's A rows (R: their ranks summed over adapters and parts)
    b: torch.Tensor  # [out, R]: every adapter's B columns times its alpha / rank, each part's in its own rows
    owner: torch.Tensor  # [R]: the adapter each rank column belongs to

    def delta(self, x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """The adapters' addition to x @ W^T for rows x [rows, in], scales [rows, n_adapters] (in x's dtype)."""
        return F.linear(F.linear(x, self.a) * scales[:, self.owner], self.b)


def with_low_rank(y: torch.Tensor, x: torch.Tensor, low_rank: LowRank | None,
                  scales: torch.Tensor | None) -> torch.Tensor:
    """y (= x @ W^T) with W's adapters added for the rows' scales (none loaded, or no scales: y itself)."""
    if low_rank is None or scales is None:
        return y
    return y + low_rank.delta(x, scales)
