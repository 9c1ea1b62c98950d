"""Mixture-of-experts feed-forward: each token's chosen experts (SwiGLU each) summed with the routing weights.

Expert weights are stacked as in GGUF: gate_up [n_expert, 2 ffn, hidden] ([gate | up] along dim 1) and down
[n_expert, hidden, ffn], either float tensors or packed (`QuantExperts`: one QuantWeight holding every
expert's rows, expert e's at a fixed offset). A runner's kernels run them (`TorchKernels.moe_experts`): packed
experts where Triton runs on kernels that read only the chosen experts' packed weights (few tokens in bf16 on
CUDA: the tensor-core pairs of moe_experts_cuda.py; otherwise the Triton kernels of moe_experts_triton.py);
float experts through torch (`moe_experts_ref`), grouped by expert, and so do packed ones on a CPU with the
packed-weight kernels (each chosen expert's two products on them). Either way each (token, slot) pair's
output is its own and a token's slots are summed in slot order, so the sum does not depend on how the
pairs were grouped. The decoder-step op is moe_step.NormMoeAdd.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from specserve.kernels.activation import silu_mul_ref
from specserve.kernels.linear import linear_ref
from specserve.kernels.quant_experts import ExpertMatrix, QuantExperts
from specserve.kernels.quant_weight import QuantWeight, Weight

Linear = Callable[..., torch.Tensor]  # (x, w, bias=None, silu_input=False, out_dtype=None): linear_ref's


def _expert_out(h: torch.Tensor, w_gate_up: Weight, w_down: Weight, linear: Linear) -> torch.Tensor:
    if isinstance(w_gate_up, QuantWeight):  # one packed expert: the dense feed-forward's products (CPU kernels)
        return linear(linear(h, w_gate_up), w_down, silu_input=True)
    assert isinstance(w_down, torch.Tensor), "float or packed, not mixed"
    return F.linear(silu_mul_ref(F.linear(h, w_gate_up)), w_down)


def _expert(w: ExpertMatrix, e: int) -> Weight:
    return w.expert(e) if isinstance(w, QuantExperts) else w[e]


def moe_experts_ref(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate_up: ExpertMatrix,
                    w_down: ExpertMatrix, *, by_expert: bool = True, linear: Linear = linear_ref) -> torch.Tensor:
    """sum over j of weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t), e = ids[t, j]; in x's dtype.

    x [n, hidden]; ids [n, k] long; weights [n, k] fp32. by_expert: one product per chosen expert over
    the rows that chose it (the expert counts are read on the host). Otherwise every expert runs over
    every row and keeps the pairs that chose it: no host sync (what a CUDA graph can capture), more work.
    Float stacks, or (by_expert) packed ones: each chosen expert's products through `linear` (a runner's
    kernels' where they multiply packed matrices)."""
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
                pairs[chosen] = _expert_out(x[chosen // k], _expert(w_gate_up, expert), _expert(w_down, expert),
                                              linear).float()
                start += count
    else:
        assert isinstance(w_gate_up, torch.Tensor) and isinstance(w_down, torch.Tensor), "packed: by expert"
        for expert in range(w_gate_up.shape[0]):
            out = _expert_out(x, w_gate_up[expert], w_down[expert], linear).float().repeat_interleave(k, dim=0)
            pairs = torch.where((flat_ids == expert)[:, None], out, pairs)
    weighted = pairs.view(n, k, -1) * weights.float()[..., None]
    return weighted.sum(dim=1).to(x.dtype)
