"""Mixture-of-experts feed-forward: each token's chosen experts (SwiGLU each) summed with the routing weights.

Expert weights are stacked as in GGUF: gate_up [n_expert, 2 ffn, hidden] ([gate | up] along dim 1) and down
[n_expert, hidden, ffn]. `moe_experts` groups the (token, slot) pairs by expert, so each chosen expert is
one product over the rows that chose it and no other expert's weights are read. Each pair's output lands
in its own slot and a token's slots are summed in slot order, so the sum does not depend on how the rows
were grouped. `NormMoeAdd` is the decoder-step op (kernels.linear's ResidualStream): RMSNorm, router
product, routing (kernels.moe_routing), experts, an optional shared expert, added to the stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.kernels.activation import silu_mul_ref
from specserve.kernels.linear import ResidualStream, Weight, feed_forward, linear
from specserve.kernels.moe_routing import Routing


def _expert_out(h: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    return F.linear(silu_mul_ref(F.linear(h, w_gate_up)), w_down)


def moe_experts_ref(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
                    w_down: torch.Tensor, *, by_expert: bool = True) -> torch.Tensor:
    """sum over j of weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t), e = ids[t, j]; in x's dtype.

    x [n, hidden]; ids [n, k] long; weights [n, k] fp32. by_expert: one product per chosen expert over
    the rows that chose it (the expert counts are read on the host). Otherwise every expert runs over
    every row and keeps the pairs that chose it: no host sync (what a CUDA graph can capture), more work."""
    n, k = ids.shape
    pairs = torch.zeros(n * k, x.shape[-1], dtype=torch.float32, device=x.device)  # pair (t, j) at t * k + j
    flat_ids = ids.reshape(-1)
    if by_expert:
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=w_gate_up.shape[0]).tolist()
        start = 0
        for expert, count in enumerate(counts):
            if count:
                chosen = order[start : start + count]
                pairs[chosen] = _expert_out(x[chosen // k], w_gate_up[expert], w_down[expert]).float()
                start += count
    else:
        for expert in range(w_gate_up.shape[0]):
            out = _expert_out(x, w_gate_up[expert], w_down[expert]).float().repeat_interleave(k, dim=0)
            pairs = torch.where((flat_ids == expert)[:, None], out, pairs)
    weighted = pairs.view(n, k, -1) * weights.float()[..., None]
    return weighted.sum(dim=1).to(x.dtype)


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor) -> torch.Tensor:
    """The experts of `moe_experts_ref`. The dispatch point for a grouped expert kernel (quantized weights,
    reading only the chosen experts, graph-safe); until then the reference runs, grouped by expert except
    while a CUDA graph is being captured (the grouping needs the expert counts on the host)."""
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    return moe_experts_ref(x, ids, weights, w_gate_up, w_down, by_expert=not capturing)


@dataclass
class SharedExpert:
    """A dense SwiGLU expert every token runs (qwen2moe's), optionally scaled by sigmoid(x . gate)."""

    w_gate_up: Weight  # [2 ffn_shared, hidden]
    w_down: Weight  # [hidden, ffn_shared]
    gate: torch.Tensor | None  # [1, hidden] (ffn_gate_inp_shexp)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        y = feed_forward(h, self.w_gate_up, self.w_down)
        return y if self.gate is None else y * torch.sigmoid(F.linear(h, self.gate))  # (one output column)


@dataclass
class NormMoeAdd:
    """stream += the mixture of experts of the stream's RMSNorm (+ the shared expert's output)."""

    norm: torch.Tensor
    eps: float
    router: torch.Tensor  # [n_expert, hidden] (ffn_gate_inp)
    routing: Routing
    w_gate_up: torch.Tensor  # [n_expert, 2 ffn_expert, hidden]
    w_down: torch.Tensor  # [n_expert, hidden, ffn_expert]
    shared: SharedExpert | None = None

    def fusable(self, x: torch.Tensor) -> bool:
        """No fused MoE kernel yet: a step with MoE layers runs its ops unfused."""
        return False

    def __call__(self, stream: ResidualStream) -> None:
        assert not stream.fused, "MoE layers run on unfused steps (fusable is False)"
        h = stream.normed(self.norm, self.eps)
        ids, weights = self.routing(linear(h, self.router, out_dtype=torch.float32))
        y = moe_experts(h, ids, weights, self.w_gate_up, self.w_down)
        if self.shared is not None:
            y = y + self.shared(h)
        stream.add(y)
