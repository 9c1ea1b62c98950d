"""Few-token mixture of experts on the CUDA tensor-core kernel (gemv_mma.cu's expert pairs).

Decode and verify steps: each (token, slot) pair is one block row of `quant_cuda.expert_gemv`, which
reads the pair's expert id on the device and then only that expert's packed rows, at the dense
products' bandwidth. gate|up comes out with its SwiGLU applied (the kernel's SWIGLU epilogue), down as
one fp32 row per pair (each rounded to bf16 first, as the reference's product is), and the slots are
summed in slot order (`moe_experts_triton.slot_sum`). A pair's sums never depend on the other pairs,
so a verify step computes what decode steps compute; nothing is read back to the host (graph-safe).
`quant_cuda.experts_usable` says where it runs.
"""

from __future__ import annotations

import torch

from specserve.kernels import quant_cuda
from specserve.kernels.moe_experts_triton import slot_sum
from specserve.kernels.quant_weight import QuantWeight
from specserve.kernels.settings import settings

# Every pair reads its expert's rows on its own: past this many tokens the same experts are read over and over
# (16 tokens: 128 pairs), and the Triton paths (grouped by expert past MAX_PAIR_TOKENS) take over.
MAX_TOKENS = 16


def enabled() -> bool:
    """SPECSERVE_MOE_KERNEL=triton runs the Triton pairs instead (A/B runs; callers never choose)."""
    return settings().moe_kernel != "triton"


def pairs(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: QuantWeight, down: QuantWeight,
          n_expert: int) -> torch.Tensor:
    """sum over slots j, in order, of weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t), e = ids[t, j]."""
    act = quant_cuda.expert_gemv(x, ids, gate_up, n_expert, x.dtype, by_token=True, swiglu_output=True)
    per_pair = quant_cuda.expert_gemv(act, ids, down, n_expert, torch.float32, by_token=False)
    return slot_sum(per_pair, weights, x.dtype)
