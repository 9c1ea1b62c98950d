"""The mixture-of-experts decoder-step op (kernels.step_ops' ResidualStream): RMSNorm, router product, routing
(kernels.moe_routing), the chosen experts (kernels.moe_experts), an optional shared expert, added to the stream."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.kernels.moe_routing import Routing
from specserve.kernels.quant_experts import ExpertMatrix
from specserve.kernels.quant_weight import Weight
from specserve.kernels.step_ops import ResidualStream, feed_forward
from specserve.kernels.torch_kernels import TorchKernels


@dataclass
class SharedExpert:
    """A dense SwiGLU expert every token runs (qwen2moe's), optionally scaled by sigmoid(x . gate)."""

    w_gate_up: Weight  # [2 ffn_shared, hidden]
    w_down: Weight  # [hidden, ffn_shared]
    gate: torch.Tensor | None  # [1, hidden] (ffn_gate_inp_shexp)

    def __call__(self, h: torch.Tensor, kernels: TorchKernels) -> torch.Tensor:
        y = feed_forward(h, self.w_gate_up, self.w_down, kernels)
        return y if self.gate is None else y * torch.sigmoid(F.linear(h, self.gate))  # (one output column)


@dataclass
class NormMoeAdd:
    """stream += the mixture of experts of the stream's RMSNorm (+ the shared expert's output)."""

    norm: torch.Tensor
    eps: float
    router: torch.Tensor  # [n_expert, hidden] (ffn_gate_inp)
    routing: Routing
    w_gate_up: ExpertMatrix  # [n_expert, 2 ffn_expert, hidden]
    w_down: ExpertMatrix  # [n_expert, hidden, ffn_expert]
    shared: SharedExpert | None = None

    def fusable(self, x: torch.Tensor, kernels: TorchKernels) -> bool:
        """The expert kernels fold in neither the RMSNorm nor the residual add: a step with MoE layers runs
        its ops unfused."""
        return False

    def __call__(self, stream: ResidualStream) -> None:
        assert not stream.fused, "MoE layers run on unfused steps (fusable is False)"
        kernels = stream.kernels
        h = stream.normed(self.norm, self.eps)
        ids, weights = kernels.route(kernels.linear(h, self.router, out_dtype=torch.float32), self.routing)
        y = kernels.moe_experts(h, ids, weights, self.w_gate_up, self.w_down)
        if self.shared is not None:
            y = y + self.shared(h, kernels)
        stream.add(y)
