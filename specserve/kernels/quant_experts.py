"""A stack of packed expert matrices (MoE): the type the loader, the model and the expert kernels share."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.kernels.quant_weight import QuantWeight, concat_quant, dequantize_ref
from specserve.kernels.quant_weight import quantize_q8 as quantize_matrix_q8


@dataclass
class QuantExperts:
    """n_expert packed matrices [N, K] stacked along N in one QuantWeight [n_expert * N, K]: expert e's rows
    are e * N .. (e + 1) * N - 1, so its words and scales sit at a fixed offset and a kernel handed the
    expert id reads those alone."""

    w: QuantWeight
    n_expert: int

    @property
    def shape(self) -> torch.Size:
        """(n_expert, N, K), as the float stack's."""
        rows, k = self.w.shape
        return torch.Size((self.n_expert, rows // self.n_expert, k))

    def n_bytes(self) -> int:
        return self.w.n_bytes()

    def expert(self, e: int) -> QuantWeight:
        """Expert e's matrix (views of the stack)."""
        n = self.shape[1]
        return QuantWeight(self.w.words[e * n : (e + 1) * n], self.w.sm[e * n : (e + 1) * n], self.w.bits,
                           self.w.group, self.w.u_max)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_ref(self.w, dtype).view(self.shape)

    def to(self, device: torch.device | str) -> QuantExperts:
        w = self.w
        return QuantExperts(QuantWeight(w.words.to(device), w.sm.to(device), w.bits, w.group, w.u_max), self.n_expert)

    @classmethod
    def concat(cls, parts: list[QuantExperts]) -> QuantExperts:
        """Per expert, the parts' rows one after the other ([gate | up] of each expert), on the smallest group
        and the widest integers (as concat_quant)."""
        n_expert = parts[0].n_expert
        assert all(p.n_expert == n_expert and p.shape[1:] == parts[0].shape[1:] for p in parts)
        both = concat_quant([p.w for p in parts])  # [part][expert][row]: every part's experts in turn

        def per_expert(t: torch.Tensor) -> torch.Tensor:
            return t.view(len(parts), n_expert, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()

        return cls(QuantWeight(per_expert(both.words), per_expert(both.sm), both.bits, both.group, both.u_max),
                   n_expert)

    @classmethod
    def quantize_q8(cls, w: torch.Tensor) -> QuantExperts:
        """A float stack [n_expert, N, K] with Q8_0's rule (random-weight benchmarks, the q8 weight format)."""
        n_expert, n, k = w.shape
        return cls(quantize_matrix_q8(w.reshape(n_expert * n, k)), n_expert)


ExpertMatrix = torch.Tensor | QuantExperts
