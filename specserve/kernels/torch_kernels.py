"""The ops a model step calls, as one object per runner: here torch's references, which run on any device.

`kernels.backend.kernels_for` chooses a runner's kernels once, when it is built: these, the C kernels of the
CPU (cpu_kernels.py) or the Triton and CUDA kernels (triton_kernels.py), each a subclass that overrides the
ops it has kernels for and falls back to these for inputs its kernels do not take (a dtype, a head size). The
step's ops (step_ops.py) reach them through the ResidualStream they work on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.kernels.activation import silu_mul_ref
from specserve.kernels.attention import attention_ref
from specserve.kernels.kv_format import store_rows
from specserve.kernels.moe_experts import moe_experts_ref
from specserve.kernels.moe_routing import Routing, route_ref
from specserve.kernels.quant_experts import ExpertMatrix, QuantExperts
from specserve.kernels.quant_weight import QuantWeight, Weight, dequantize_ref
from specserve.kernels.rmsnorm import add_rms_norm_ref, rms_norm_ref
from specserve.kernels.rope import rope_and_cache_ref
from specserve.kernels.settings import KernelSettings, settings

Runs = list[tuple[int, int, int, int]]  # Batch.runs(): (seq, start_row, end_row, kv_len)
HeadNorms = tuple[torch.Tensor, torch.Tensor, float]  # (q weight, k weight, eps) of the per-head RMSNorms


class TorchKernels:
    """torch's reference of every op."""

    name = "torch"

    def __init__(self, kernel_settings: KernelSettings | None = None, invariant: bool = False) -> None:
        self.settings = kernel_settings or settings()
        self.invariant = invariant  # batch-invariant products (kernels/batch_invariant.py; CUDA only)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(invariant={self.invariant})"

    @property
    def experts_packed(self) -> bool:
        """Whether packed experts run as they are (elsewhere a loader dequantizes them)."""
        return False

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm_ref(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual)."""
        return add_rms_norm_ref(x, residual, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul_ref(gate_up)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's index of its largest logit (the first where several tie)."""
        return logits.argmax(dim=-1)

    def rope_and_cache(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_table: torch.Tensor,
                       sin_table: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, style: str, head_norms: HeadNorms | None = None) -> torch.Tensor:
        """rope.rope_and_cache_ref, each q and k head RMS-normalised first where head_norms are given."""
        if head_norms is not None:
            q, k = self.rms_norm(q, head_norms[0], head_norms[2]), self.rms_norm(k, head_norms[1], head_norms[2])
        return self.rope_write(q, k, v, cos_table, sin_table, positions, slots, k_cache, v_cache, style)

    def rope_write(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_table: torch.Tensor,
                   sin_table: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, style: str) -> torch.Tensor:
        """rope_and_cache without head norms."""
        return rope_and_cache_ref(q, k, v, cos_table, sin_table, positions, slots, k_cache, v_cache, style)

    def store_staged(self, staged: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor) -> None:
        """Rows of K and V (staged [2, rows, n_kv_heads, 1, head_dim], in the compute dtype) into each row's slot of
        the caches, in each cache's type (kv_format.py)."""
        for cache, new in ((k_cache, staged[0, :, :, 0]), (v_cache, staged[1, :, :, 0])):
            self.store_rows(new, slots, cache)

    def store_rows(self, rows: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor) -> None:
        """rows [tokens, n_kv_heads, head_dim] into each token's slot of one layer's cache, in its type."""
        size = cache.shape[2]
        store_rows(cache, torch.div(slots, size, rounding_mode="floor"), slots % size, rows)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                  seq_ids: torch.Tensor, table: torch.Tensor, runs: Runs, scale: float,
                  hidden: torch.Tensor | None = None, prompt: bool = False) -> torch.Tensor:
        """attention.attention_ref (the kernels read each row's sequence and position on the device instead of
        `runs`). hidden: a token tree's rows (KVStep.hidden); prompt: the step reads prompt chunks (KVStep.prompt)."""
        return attention_ref(q, k_cache, v_cache, positions, table, runs, scale, hidden)

    def linear(self, x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None, silu_input: bool = False,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """y = act(x) @ W^T + bias, act = silu_mul when silu_input (x is then [.., 2K]); y in out_dtype."""
        if silu_input:
            x = self.silu_mul(x)
        weight = self.dequantize(w, x.dtype) if isinstance(w, QuantWeight) else w
        y = F.linear(x, weight, bias)
        return y if out_dtype is None else y.to(out_dtype)

    def dequantize(self, w: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_ref(w, dtype)

    def fusable(self, x: torch.Tensor, w: Weight, norm_input: bool = False) -> bool:
        """Whether x @ w^T runs on the tensor-core kernel that folds in norms, adds and RoPE (step_ops)."""
        return False

    def route(self, logits: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's routing.k experts and their weights (moe_routing.route_ref says how)."""
        return route_ref(logits, routing.k, gating=routing.gating, bias=routing.bias, norm=routing.norm,
                         clamp=routing.clamp, scale=routing.scale, delayed_softmax=routing.delayed_softmax)

    def moe_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate_up: ExpertMatrix,
                    w_down: ExpertMatrix) -> torch.Tensor:
        """The chosen experts' SwiGLU outputs summed with their weights (moe_experts.moe_experts_ref); packed
        experts are dequantized per call here (loaders keep them float where no kernel runs them)."""
        if ids.shape[0] == 0:
            return x.new_zeros(x.shape)
        if isinstance(w_gate_up, QuantExperts) and isinstance(w_down, QuantExperts):
            w_gate_up, w_down = w_gate_up.dequantize(x.dtype), w_down.dequantize(x.dtype)
        assert isinstance(w_gate_up, torch.Tensor) and isinstance(w_down, torch.Tensor), "float or packed, not mixed"
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        return moe_experts_ref(x, ids, weights, w_gate_up, w_down, by_expert=not capturing, linear=self.linear)
