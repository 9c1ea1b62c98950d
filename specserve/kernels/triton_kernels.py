"""A CUDA runner's ops on the Triton kernels and the CUDA C ones (quant_cuda.py: packed products on the tensor
cores; moe_experts_cuda.py), with torch's references for what they do not take. Also what the kernel tests run
on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1).

Products (kernels.linear says why): packed matrices of up to MAX_SLICED_ROWS rows on the tensor-core kernel,
batch-invariant steps on it for any row count; a matrix's dense copy for steps of many rows; up to
MAX_GEMV_ROWS rows (packed) or one row (float) on Triton's GEMV; the rest on cuBLAS.
"""

from __future__ import annotations

import torch

from specserve.kernels import (
    activation_triton,
    attention_triton,
    batch_invariant,
    kv_pack_triton,
    linear_triton,
    moe_experts_cuda,
    moe_experts_triton,
    moe_routing_triton,
    quant_cuda,
    rmsnorm_triton,
    rope_triton,
)
from specserve.kernels.linear import dense_copy
from specserve.kernels.moe_routing import FUSED_DTYPES, FUSED_N_EXPERT, Routing, check
from specserve.kernels.quant_experts import ExpertMatrix, QuantExperts
from specserve.kernels.quant_weight import MAX_GEMV_ROWS, MAX_SLICED_ROWS, QuantWeight, Weight
from specserve.kernels.torch_kernels import HeadNorms, Runs, TorchKernels

ATTENTION_HEAD_DIMS = (64, 128, 256)  # the head sizes the Triton attention is built for


class TritonKernels(TorchKernels):
    name = "triton"

    @property
    def experts_packed(self) -> bool:
        return True

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rmsnorm_triton.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return rmsnorm_triton.add_rms_norm(x, residual, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return activation_triton.silu_mul(gate_up)

    def rope_and_cache(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_table: torch.Tensor,
                       sin_table: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, style: str, head_norms: HeadNorms | None = None) -> torch.Tensor:
        """One launch with the head norms, where RoPE rotates whole heads; K or V stored in another type (-ctk /
        -ctv) are rotated into staging rows first, then stored as their type."""
        if 2 * cos_table.shape[-1] != q.shape[-1]:
            return super().rope_and_cache(q, k, v, cos_table, sin_table, positions, slots, k_cache, v_cache, style,
                                          head_norms)
        if k_cache.dtype == v_cache.dtype == q.dtype:
            return rope_triton.rope_and_cache(q, k, v, cos_table, sin_table, positions, slots, k_cache, v_cache,
                                              style, head_norms)
        if not kv_pack_triton.takes(q.shape[-1]):
            return super().rope_and_cache(q, k, v, cos_table, sin_table, positions, slots, k_cache, v_cache, style,
                                          head_norms)
        staged = torch.empty((2, k.shape[0], k.shape[1], 1, k.shape[2]), dtype=q.dtype, device=q.device)
        rows = torch.arange(k.shape[0], device=q.device)
        q_out = rope_triton.rope_and_cache(q, k, v, cos_table, sin_table, positions, rows, staged[0], staged[1],
                                           style, head_norms)
        self.store_staged(staged, slots, k_cache, v_cache)
        return q_out

    def store_rows(self, rows: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor) -> None:
        """Packed caches (q8_0, q4_0) through the Triton packing kernel, where it takes the head size."""
        if cache.dtype == torch.uint8 and kv_pack_triton.takes(rows.shape[-1]):
            kv_pack_triton.pack_rows(rows, slots, cache)
        else:
            super().store_rows(rows, slots, cache)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                  seq_ids: torch.Tensor, table: torch.Tensor, runs: Runs, scale: float,
                  hidden: torch.Tensor | None = None, prompt: bool = False) -> torch.Tensor:
        """The kernel reads (sequence, position) per row on the device and ignores `runs`, so its launch does not
        depend on the batch's layout on the host (graph-capturable). Prompt steps tile their one-sequence rows
        (not batch-invariant ones: a row's bits would follow its tile)."""
        if q.shape[-1] in ATTENTION_HEAD_DIMS:
            return attention_triton.attention(q, k_cache, v_cache, positions, seq_ids, table, scale, hidden,
                                              tiled=prompt and not self.invariant)
        return super().attention(q, k_cache, v_cache, positions, seq_ids, table, runs, scale, hidden, prompt)

    def linear(self, x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None, silu_input: bool = False,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        dense = dense_copy(x, w, self.invariant)
        w = w if dense is None else dense
        rows = x.numel() // x.shape[-1]
        if isinstance(w, QuantWeight) and (rows <= MAX_SLICED_ROWS or self.invariant):
            kernel = quant_cuda.usable(x, w, bias, out_dtype or x.dtype)
            if kernel:
                return quant_cuda.gemv(x, w, bias, silu_input, out_dtype or x.dtype, kernel=kernel)
        if self.invariant:  # one kernel for every row count: float products in fixed slices
            weight = self.dequantize(w, x.dtype) if isinstance(w, QuantWeight) else w
            y = batch_invariant.linear_float(self.silu_mul(x) if silu_input else x, weight, bias)
            return y if out_dtype is None else y.to(out_dtype)
        if rows <= MAX_GEMV_ROWS and (isinstance(w, QuantWeight) or (rows == 1 and self.settings.triton_gemv)):
            return linear_triton.gemv(x, w, bias, silu_input, out_dtype or x.dtype)
        return super().linear(x, w, bias, silu_input, out_dtype)

    def dequantize(self, w: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
        return linear_triton.dequantize(w, dtype)

    def fusable(self, x: torch.Tensor, w: Weight, norm_input: bool = False) -> bool:
        """With norm_input the kernel also folds in the RMSNorm of x (K staged whole)."""
        rows = x.numel() // x.shape[-1]
        if not isinstance(w, QuantWeight) or not (rows <= MAX_SLICED_ROWS or self.invariant):
            return False
        if dense_copy(x, w, self.invariant) is not None:
            return False
        return quant_cuda.usable(x, w, None, x.dtype) == "gemv_mma" and (not norm_input or quant_cuda.norm_fusable(w))

    def route(self, logits: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused kernel on float logits of FUSED_N_EXPERT experts."""
        r = routing
        check(logits, r.k, r.gating, r.bias, r.norm, r.delayed_softmax)
        if logits.shape[1] not in FUSED_N_EXPERT or logits.dtype not in FUSED_DTYPES:
            return super().route(logits, routing)
        return moe_routing_triton.route(logits, r.k, gating=r.gating, bias=r.bias, norm=r.norm, clamp=r.clamp,
                                        scale=r.scale, delayed_softmax=r.delayed_softmax)

    def moe_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate_up: ExpertMatrix,
                    w_down: ExpertMatrix) -> torch.Tensor:
        """Packed experts: kernels that read only the chosen experts' weights and never sync with the host (CUDA
        graph safe): the tensor-core pairs for few tokens in bf16, the Triton kernels otherwise."""
        if not (isinstance(w_gate_up, QuantExperts) and isinstance(w_down, QuantExperts)):
            return super().moe_experts(x, ids, weights, w_gate_up, w_down)
        if ids.shape[0] == 0:
            return x.new_zeros(x.shape)
        if (moe_experts_cuda.enabled() and ids.shape[0] <= moe_experts_cuda.MAX_TOKENS
                and quant_cuda.experts_usable(x, w_gate_up.w, w_down.w)):
            return moe_experts_cuda.pairs(x, ids, weights, w_gate_up.w, w_down.w, w_gate_up.n_expert)
        return moe_experts_triton.moe_experts(x, ids, weights, w_gate_up, w_down)
