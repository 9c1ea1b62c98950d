"""A CPU runner's ops on the C kernels (cpu_ops.py for the small ops, quant_cpu.py for packed products), with
torch's references for what they do not take (a dtype other than fp32, a view of odd strides)."""

from __future__ import annotations

import torch

from specserve.kernels import cpu_ops, quant_cpu
from specserve.kernels.moe_experts import moe_experts_ref
from specserve.kernels.quant_experts import ExpertMatrix, QuantExperts
from specserve.kernels.quant_weight import QuantWeight, Weight
from specserve.kernels.torch_kernels import Runs, TorchKernels


class CpuKernels(TorchKernels):
    name = "cpu"

    @property
    def experts_packed(self) -> bool:
        return quant_cpu.kernel_built()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if cpu_ops.takes(x, weight):
            return cpu_ops.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if x.shape == residual.shape and cpu_ops.takes(x, residual, weight):
            return cpu_ops.add_rms_norm(x, residual, weight, eps)
        return super().add_rms_norm(x, residual, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if cpu_ops.takes(gate_up):
            return cpu_ops.silu_mul(gate_up)
        return super().silu_mul(gate_up)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.dim() == 2 and cpu_ops.takes(logits):
            return cpu_ops.argmax(logits)
        return super().argmax(logits)

    def rope_write(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_table: torch.Tensor,
                   sin_table: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, style: str) -> torch.Tensor:
        if cpu_ops.rope_takes(q, k, v, positions, slots, k_cache, v_cache) and cos_table.dtype == torch.float32:
            return cpu_ops.rope_and_cache(q, k, v, cos_table, sin_table, positions, slots, k_cache, v_cache, style)
        return super().rope_write(q, k, v, cos_table, sin_table, positions, slots, k_cache, v_cache, style)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                  seq_ids: torch.Tensor, table: torch.Tensor, runs: Runs, scale: float,
                  hidden: torch.Tensor | None = None, prompt: bool = False) -> torch.Tensor:
        if cpu_ops.attention_takes(q, k_cache, v_cache, positions, seq_ids, table):
            return cpu_ops.attention(q, k_cache, v_cache, positions, seq_ids, table, scale, hidden)
        return super().attention(q, k_cache, v_cache, positions, seq_ids, table, runs, scale, hidden, prompt)

    def linear(self, x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None, silu_input: bool = False,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if isinstance(w, QuantWeight):  # first: a decode step makes ~120 of these
            y = quant_cpu.product(x, w, bias, out_dtype, self.silu_mul if silu_input else None)
            if y is not None:
                return y
        return super().linear(x, w, bias, silu_input, out_dtype)

    def moe_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate_up: ExpertMatrix,
                    w_down: ExpertMatrix) -> torch.Tensor:
        """Packed experts: each chosen expert's two products on the packed kernels, grouped by expert."""
        if isinstance(w_gate_up, QuantExperts) and isinstance(w_down, QuantExperts) and self.experts_packed:
            if ids.shape[0] == 0:
                return x.new_zeros(x.shape)
            return moe_experts_ref(x, ids, weights, w_gate_up, w_down, linear=self.linear)
        return super().moe_experts(x, ids, weights, w_gate_up, w_down)
