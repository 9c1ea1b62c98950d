"""Mixture-of-experts feed-forward: each token's chosen experts (SwiGLU each) summed with the routing weights.

Expert weights are stacked as in GGUF: gate_up [n_expert, 2 ffn, hidden] ([gate | up] along dim 1) and down
[n_expert, hidden, ffn], either float tensors or packed (`QuantExperts`: one QuantWeight holding every
expert's rows, expert e's at a fixed offset). `moe_experts` dispatches: packed experts where Triton runs go
to kernels that read only the chosen experts' packed weights (few tokens in bf16 on CUDA: the tensor-core
pairs of moe_experts_cuda.py; otherwise the Triton kernels of moe_experts_triton.py); float
experts go through torch (`moe_experts_ref`), grouped by expert, and so do packed ones on a CPU with the packed-weight
kernels (each chosen expert's two products on them). Either way each (token, slot) pair's
output is its own and a token's slots are summed in slot order, so the sum does not depend on how the
pairs were grouped. `NormMoeAdd` is the decoder-step op (kernels.step_ops' ResidualStream): RMSNorm,
router product, routing (kernels.moe_routing), experts, an optional shared expert, added to the stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.kernels.activation import silu_mul_ref
from specserve.kernels.dispatch import triton_device, triton_enabled
from specserve.kernels.linear import linear
from specserve.kernels.moe_routing import Routing
from specserve.kernels.quant_experts import ExpertMatrix, QuantExperts
from specserve.kernels.quant_weight import QuantWeight, Weight
from specserve.kernels.step_ops import ResidualStream, feed_forward


def _expert_out(h: torch.Tensor, w_gate_up: Weight, w_down: Weight) -> torch.Tensor:
    if isinstance(w_gate_up, QuantWeight):  # one packed expert: the dense feed-forward's products (CPU kernels)
        return feed_forward(h, w_gate_up, w_down)
    assert isinstance(w_down, torch.Tensor), "float or packed, not mixed"
    return F.linear(silu_mul_ref(F.linear(h, w_gate_up)), w_down)


def _expert(w: ExpertMatrix, e: int) -> Weight:
    return w.expert(e) if isinstance(w, QuantExperts) else w[e]


def moe_experts_ref(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate_up: ExpertMatrix,
                    w_down: ExpertMatrix, *, by_expert: bool = True) -> torch.Tensor:
    """sum over j of weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t), e = ids[t, j]; in x's dtype.

    x [n, hidden]; ids [n, k] long; weights [n, k] fp32. by_expert: one product per chosen expert over
    the rows that chose it (the expert counts are read on the host). Otherwise every expert runs over
    every row and keeps the pairs that chose it: no host sync (what a CUDA graph can capture), more work.
    Float stacks, or (by_expert) packed ones: each chosen expert's products through kernels.linear."""
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
                pairs[chosen] = _expert_out(x[chosen // k], _expert(w_gate_up, expert), _expert(w_down, expert)).float()
                start += count
    else:
        assert isinstance(w_gate_up, torch.Tensor) and isinstance(w_down, torch.Tensor), "packed: by expert"
        for expert in range(w_gate_up.shape[0]):
            out = _expert_out(x, w_gate_up[expert], w_down[expert]).float().repeat_interleave(k, dim=0)
            pairs = torch.where((flat_ids == expert)[:, None], out, pairs)
    weighted = pairs.view(n, k, -1) * weights.float()[..., None]
    return weighted.sum(dim=1).to(x.dtype)




def experts_stay_packed(device: torch.device | str) -> bool:
    """Whether packed experts run as they are on `device`: where the Triton kernels run (CUDA, or CPU tensors
    under Triton's interpreter), or on a CPU with the packed-weight kernels (each chosen expert's products
    on them). Elsewhere torch multiplies float experts, so a loader dequantizes them."""
    if triton_device(device):
        return True
    from specserve.kernels import quant_cpu

    return torch.device(device).type == "cpu" and quant_cpu.kernel_built()


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate_up: ExpertMatrix,
                w_down: ExpertMatrix) -> torch.Tensor:
    """The experts of `moe_experts_ref`, over float or packed expert stacks (both of one kind).

    Packed, where Triton runs: the grouped kernels (moe_experts_triton), which read only the chosen
    experts' weights and never sync with the host (CUDA-graph safe). Float: the reference, grouped by
    expert except while a CUDA graph is being captured (the grouping reads the expert counts on the host)."""
    if isinstance(w_gate_up, QuantExperts) and isinstance(w_down, QuantExperts):
        if ids.shape[0] == 0:
            return x.new_zeros(x.shape)
        if triton_enabled(x):
            from specserve.kernels import moe_experts_cuda, moe_experts_triton, quant_cuda

            if (moe_experts_cuda.enabled() and ids.shape[0] <= moe_experts_cuda.MAX_TOKENS
                    and quant_cuda.experts_usable(x, w_gate_up.w, w_down.w)):
                return moe_experts_cuda.pairs(x, ids, weights, w_gate_up.w, w_down.w, w_gate_up.n_expert)
            return moe_experts_triton.moe_experts(x, ids, weights, w_gate_up, w_down)
        if x.device.type == "cpu":  # the chosen experts' products on the CPU kernels, grouped by expert
            return moe_experts_ref(x, ids, weights, w_gate_up, w_down)
        # no kernel: every expert dequantized per call (loaders keep experts float on such devices)
        w_gate_up, w_down = w_gate_up.dequantize(x.dtype), w_down.dequantize(x.dtype)
    assert isinstance(w_gate_up, torch.Tensor) and isinstance(w_down, torch.Tensor), "float or packed, not mixed"
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
    w_gate_up: ExpertMatrix  # [n_expert, 2 ffn_expert, hidden]
    w_down: ExpertMatrix  # [n_expert, hidden, ffn_expert]
    shared: SharedExpert | None = None

    def fusable(self, x: torch.Tensor) -> bool:
        """The expert kernels fold in neither the RMSNorm nor the residual add: a step with MoE layers runs
        its ops unfused."""
        return False

    def __call__(self, stream: ResidualStream) -> None:
        assert not stream.fused, "MoE layers run on unfused steps (fusable is False)"
        h = stream.normed(self.norm, self.eps)
        ids, weights = self.routing(linear(h, self.router, out_dtype=torch.float32))
        y = moe_experts(h, ids, weights, self.w_gate_up, self.w_down)
        if self.shared is not None:
            y = y + self.shared(h)
        stream.add(y)
