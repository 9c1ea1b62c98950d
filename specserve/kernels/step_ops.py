"""Decoder-step ops: RMSNorm -> product (+ RoPE and the KV write) -> add to the residual stream.

The model calls them on a `ResidualStream`, which carries the runner's kernels (backend.py chose them when the
runner was built); whether they fold the norms, RoPE and the adds into the products (the tensor-core kernel:
`linear_fused`, `feed_forward`) or compose them (the kernels' `linear`, `rms_norm`, ...) is decided here, once
per step for all of its ops (`StepFusion`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specserve.kernels.low_rank import LowRank, with_low_rank
from specserve.kernels.quant_weight import QuantWeight, Weight
from specserve.kernels.rope import RopeWrite
from specserve.kernels.torch_kernels import TorchKernels


def linear_fused(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None, *,
                 norm: tuple[torch.Tensor, float] | None = None, add_to: torch.Tensor | None = None,
                 rope: RopeWrite | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """A product on the tensor-core kernel (`TorchKernels.fusable` says when) with the RMSNorm of x, norm = (weight,
    eps), folded into its input, and its result added to `add_to` in place (then returned), or, for a
    [q | k | v] matrix, rotated (RoPE) with k and v written to the KV cache and q returned. Same
    roundings as rms_norm, linear, a bf16 addition, rope_and_cache."""
    from specserve.kernels import quant_cuda

    return quant_cuda.gemv(x, w, bias, False, out_dtype or x.dtype, kernel="gemv_mma", norm=norm, add_to=add_to,
                            rope=rope)


def feed_forward(x: torch.Tensor, w_gate_up: Weight, w_down: Weight, kernels: TorchKernels, *,
                 norm: tuple[torch.Tensor, float] | None = None, add_to: torch.Tensor | None = None,
                 adapters: tuple[LowRank | None, LowRank | None, torch.Tensor] | None = None) -> torch.Tensor:
    """down(silu(gate) * up) with [gate | up] = x @ w_gate_up^T. Where both products are `fusable`,
    SwiGLU runs in gate_up's output (down then stages plain activations), and norm / add_to fold in as
    in linear_fused; elsewhere SwiGLU runs in down's input (norm and add_to are then not allowed).
    Both ways round gate, up, silu(gate) and the product to bf16 alike: the same values. adapters: the two
    products' LowRank and the rows' adapter scales (composed, never fused)."""
    if adapters is not None:
        gate_up, down, scales = adapters
        act = kernels.silu_mul(with_low_rank(kernels.linear(x, w_gate_up), x, gate_up, scales))
        return with_low_rank(kernels.linear(act, w_down), act, down, scales)
    if (kernels.fusable(x, w_gate_up, norm is not None) and kernels.fusable(x, w_down)
            and w_gate_up.shape[0] % 16 == 0):
        assert isinstance(w_gate_up, QuantWeight) and isinstance(w_down, QuantWeight)  # (fusable: packed)
        from specserve.kernels import quant_cuda

        act = quant_cuda.gemv(x, w_gate_up, None, False, x.dtype, kernel="gemv_mma", swiglu_output=True, norm=norm)
        return quant_cuda.gemv(act, w_down, None, False, x.dtype, kernel="gemv_mma", add_to=add_to)
    assert norm is None and add_to is None, "RMSNorm and the residual add fold in only on the tensor-core kernel"
    return kernels.linear(kernels.linear(x, w_gate_up), w_down, silu_input=True)


class ResidualStream:
    """A decoder step's residual stream [rows, hidden], as its ops read it and add to it.

    fused: each op folds the RMSNorm it needs into its product and adds its output in place, so
    `residual` is always current. Otherwise a sub-layer's output waits in `pending` for the next RMSNorm,
    which adds it in the same kernel (add_rms_norm). kernels: the runner's, which its ops run on."""

    def __init__(self, x: torch.Tensor, fused: bool, kernels: TorchKernels) -> None:
        self.residual = x
        self.pending: torch.Tensor | None = None
        self.fused = fused
        self.kernels = kernels
        self.adapter_scales: torch.Tensor | None = None  # [rows, n_adapters] where adapters are loaded (low_rank.py)
        self._staging: tuple[torch.Tensor, torch.Tensor] | None = None

    def staging(self, n_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One-position blocks for the step's K and V rows where the cache is stored apart (NormQKVRope.cache_apart):
        [2, rows, n_kv_heads, 1, head_dim] in the stream's dtype, and the rows' numbers. Made once a step: each
        layer stores its rows before the next layer writes them."""
        if self._staging is None:
            x = self.residual
            self._staging = (torch.empty((2, x.shape[0], n_kv_heads, 1, head_dim), dtype=x.dtype, device=x.device),
                             torch.arange(x.shape[0], device=x.device))
        return self._staging

    def normed(self, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of the stream, with the pending output added first (unfused ops)."""
        if self.pending is None:
            return self.kernels.rms_norm(self.residual, weight, eps)
        h, self.residual = self.kernels.add_rms_norm(self.pending, self.residual, weight, eps)
        self.pending = None
        return h

    def add(self, y: torch.Tensor) -> None:
        """Add a sub-layer's output (unfused ops): it waits for the next RMSNorm."""
        self.pending = y if self.pending is None else self.pending + y

    def keep_rows(self, rows: torch.Tensor | None) -> None:
        """Keep only `rows` (None: all), e.g. the rows whose logits are wanted."""
        if rows is None:
            return
        self.residual = self.residual[rows]
        if self.pending is not None:
            self.pending = self.pending[rows]
        if self.adapter_scales is not None:
            self.adapter_scales = self.adapter_scales[rows]


@dataclass
class NormQKVRope:
    """RMSNorm -> [q | k | v] product (+ bias) -> RMSNorm of each q and k head (head_norms) -> RoPE, with k
    and v written to each row's slot of one layer's KV cache [n_slots, n_kv_heads, head_dim]; returns the rotated q
    [rows, n_heads, head_dim]. Fused, it is one tensor-core product (RoPE and the write in its epilogue)."""

    norm: torch.Tensor
    eps: float
    w: Weight
    bias: torch.Tensor | None
    head_norms: tuple[torch.Tensor, torch.Tensor] | None  # (q, k) weights [head_dim]
    cos: torch.Tensor  # rope_cos_sin tables
    sin: torch.Tensor
    style: str
    n_heads: int
    n_kv_heads: int
    head_dim: int
    adapters: LowRank | None = None
    cache_apart: bool = False  # K or V stored in another type (-ctk/-ctv): rotated rows are staged, then stored

    def fusable(self, x: torch.Tensor, kernels: TorchKernels) -> bool:
        """The epilogue rotates whole heads of a multiple of 16 values, has no per-head RMSNorm and writes
        compute-dtype rows (staging rows, where the cache is stored apart)."""
        rope_ok = (2 * self.cos.shape[-1] == self.head_dim and self.head_dim % 16 == 0 and self.head_norms is None
                   and self.style in ("neox", "interleaved") and self.adapters is None)
        return rope_ok and kernels.fusable(x, self.w, norm_input=True) and self.norm.dtype == torch.bfloat16

    def __call__(self, stream: ResidualStream, positions: torch.Tensor, slots: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        n = stream.residual.shape[0]
        if stream.fused:
            assert isinstance(self.w, QuantWeight)  # a fused step's ops are fusable: packed
            if not self.cache_apart:
                rope = RopeWrite(self.cos, self.sin, positions, slots, k_cache, v_cache, self.n_heads,
                                 self.n_kv_heads, self.style)
                q = linear_fused(stream.residual, self.w, self.bias, norm=(self.norm, self.eps), rope=rope)
                return q.view(n, self.n_heads, self.head_dim)
            # the epilogue writes rows of one-position blocks, which are then stored as the cache's types
            staged, rows = stream.staging(self.n_kv_heads, self.head_dim)
            rope = RopeWrite(self.cos, self.sin, positions, rows, staged[0], staged[1], self.n_heads,
                             self.n_kv_heads, self.style)
            q = linear_fused(stream.residual, self.w, self.bias, norm=(self.norm, self.eps), rope=rope)
            stream.kernels.store_staged(staged, slots, k_cache, v_cache)
            return q.view(n, self.n_heads, self.head_dim)
        h = stream.normed(self.norm, self.eps)
        qkv = with_low_rank(stream.kernels.linear(h, self.w, self.bias), h, self.adapters, stream.adapter_scales)
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q = qkv[:, :q_size].view(n, self.n_heads, self.head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(n, self.n_kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size :].view(n, self.n_kv_heads, self.head_dim)
        head_norms = (*self.head_norms, self.eps) if self.head_norms is not None else None
        return stream.kernels.rope_and_cache(q, k, v, self.cos, self.sin, positions, slots, k_cache, v_cache,
                                             self.style, head_norms)


@dataclass
class LinearAdd:
    """stream += x @ w^T: the product that ends a sub-layer (attention's output matrix)."""

    w: Weight
    adapters: LowRank | None = None

    def fusable(self, x: torch.Tensor, kernels: TorchKernels) -> bool:
        return self.adapters is None and kernels.fusable(x, self.w)

    def __call__(self, stream: ResidualStream, x: torch.Tensor) -> None:
        if stream.fused:
            assert isinstance(self.w, QuantWeight)  # a fused step's ops are fusable: packed
            linear_fused(x, self.w, add_to=stream.residual)
        else:
            stream.add(with_low_rank(stream.kernels.linear(x, self.w), x, self.adapters, stream.adapter_scales))


@dataclass
class NormFeedForwardAdd:
    """stream += down(silu(gate) * up) of the stream's RMSNorm (the dense SwiGLU feed-forward)."""

    norm: torch.Tensor
    eps: float
    w_gate_up: Weight
    w_down: Weight
    gate_up_adapters: LowRank | None = None
    down_adapters: LowRank | None = None

    def fusable(self, x: torch.Tensor, kernels: TorchKernels) -> bool:
        return (self.gate_up_adapters is None and self.down_adapters is None
                and kernels.fusable(x, self.w_gate_up, norm_input=True) and kernels.fusable(x, self.w_down)
                and self.w_gate_up.shape[0] % 16 == 0 and self.norm.dtype == torch.bfloat16)

    def __call__(self, stream: ResidualStream) -> None:
        if stream.fused:
            feed_forward(stream.residual, self.w_gate_up, self.w_down, stream.kernels, norm=(self.norm, self.eps),
                         add_to=stream.residual)
        else:
            scales = stream.adapter_scales
            adapters = None if scales is None else (self.gate_up_adapters, self.down_adapters, scales)
            stream.add(feed_forward(stream.normed(self.norm, self.eps), self.w_gate_up, self.w_down, stream.kernels,
                                    adapters=adapters))


@dataclass
class NormLinear:
    """RMSNorm of the stream -> product, e.g. the output head. It ends the step, so it folds the norm in
    whenever its own product can, on a fused step."""

    norm: torch.Tensor
    eps: float
    w: Weight
    out_dtype: torch.dtype | None = None
    adapters: LowRank | None = None

    def __call__(self, stream: ResidualStream) -> torch.Tensor:
        if (stream.fused and self.adapters is None and isinstance(self.w, QuantWeight)
                and stream.kernels.fusable(stream.residual, self.w, norm_input=True)):
            return linear_fused(stream.residual, self.w, norm=(self.norm, self.eps), out_dtype=self.out_dtype)
        h = stream.normed(self.norm, self.eps)
        y = stream.kernels.linear(h, self.w, out_dtype=self.out_dtype)
        return with_low_rank(y, h, self.adapters, stream.adapter_scales)


class StepOp(Protocol):
    def fusable(self, x: torch.Tensor, kernels: TorchKernels) -> bool:
        """Whether the op can fold its norm and add into its product for a step whose residual stream is x."""
        ...


class StepFusion:
    """Opens each step's ResidualStream, fused only where every op of the step can fuse: then the stream is
    current after every op, else added to by the next RMSNorm; a mix would need separate adds where the two
    meet. Decided once per row count (the step's shapes fix it)."""

    def __init__(self, ops: list[StepOp], kernels: TorchKernels) -> None:
        self.ops = ops
        self.kernels = kernels
        self._by_rows: dict[int, bool] = {}

    def stream(self, x: torch.Tensor) -> ResidualStream:
        rows = x.shape[0]
        if rows not in self._by_rows:
            self._by_rows[rows] = all(op.fusable(x, self.kernels) for op in self.ops)
        return ResidualStream(x, self._by_rows[rows], self.kernels)
