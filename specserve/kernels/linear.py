"""Linear layers over float matrices or group-quantized, bit-packed integer matrices.

`QuantWeight` holds W[n, k] = scale * u - min per group of 16 or 32 consecutive k, with u an
unsigned 4- or 8-bit integer packed into int32 words and scale, min in fp16. Every GGUF block
format the loader reads (Q8_0, Q4_0/1, Q5_0/1, Q4_K, Q5_K, Q6_K) has this shape
(specserve.gguf.repack gives its integers exactly); Q4_K and Q4_0/1 pack into 4 bits, the
others into 8. Scales and mins are rounded to fp16 (relative error <= 2^-11, below the 2^-9
of the bf16 weights of the float path). Float matrices can be quantized with Q8_0's rule
(`quantize_q8`, exact for values that came from Q8_0).

Packing: word j of a group holds the group's k = i * (words per group) + j in bits
[bits * i, bits * (i + 1)), so each bit field i of the group's words covers a contiguous run
of k and the kernels read activations in contiguous runs.

The Triton kernels cover 1..16 rows (decode and verify steps) and can fuse SwiGLU into their
input and the bias into their output. More rows (prefill) dequantize to the activation dtype
and use cuBLAS, where arithmetic, not bytes, dominates. Triton's float kernel beats cuBLAS for
one row on every projection of qwen2.5-coder-1.5b, so one-row float products
use it; cuBLAS keeps every multi-row float product.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from specserve.errors import SpecserveError
from specserve.kernels import batch_invariant
from specserve.kernels.activation import silu_mul, silu_mul_ref
from specserve.kernels.dispatch import triton_enabled
from specserve.kernels.rmsnorm import add_rms_norm, rms_norm
from specserve.kernels.rope import RopeWrite, rope_and_cache

Q8_BLOCK = 32  # weights per scale, as GGUF's Q8_0
MAX_GEMV_ROWS = 16  # above this, cuBLAS on bf16 wins (arithmetic-bound)
# Quantized products up to this many rows take the CUDA kernels (16-row slices above 16), so a
# verify step of 17+ tokens computes what decode steps compute; longer ones (prefill) dequantize for cuBLAS.
MAX_SLICED_ROWS = 64


@dataclass
class QuantWeight:
    """W = scale * u - min per group of `group` consecutive k; u unsigned `bits`-bit integers.

    words: int32 [N, K * bits / 32] (layout in the module docstring); sm: fp16 [N, K / group, 2]
    holding (scale, min) of each group side by side, so a kernel reads both in one 4-byte load."""

    words: torch.Tensor
    sm: torch.Tensor
    bits: int
    group: int
    u_max: int = 255  # the largest u stored (Q6_K's 6-bit values: 63; CUDA converts u < 128 more cheaply)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.words.shape[0], self.words.shape[1] * 32 // self.bits))

    def n_bytes(self) -> int:
        return self.words.numel() * 4 + self.sm.numel() * 2

    @classmethod
    def from_ints(cls, q: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor | None, group: int) -> QuantWeight:
        """W = q * scale - mins (per group) from integers q [N, K] and fp32 scale, mins [N, K / group].

        Signed q are offset by the smallest power of two that makes them non-negative (Q6_K's
        [-32, 31]: 32, Q8_0's: 128) and the offset folded into the min, so u * scale - min stays
        exact (a power of two times d is exact in fp16)."""
        lo, hi = (int(q.min()), int(q.max())) if q.numel() else (0, 0)
        offset = 0 if lo >= 0 else 1 << (-lo - 1).bit_length()
        bits = 4 if hi + offset < 16 else 8
        if hi + offset >= 1 << bits:
            raise SpecserveError(f"quantized integers in [{lo}, {hi}] do not fit 8 bits")
        mins = torch.zeros_like(scale) if mins is None else mins
        sm = torch.stack([scale, mins + offset * scale], dim=-1).half()
        if not torch.isfinite(sm).all():
            raise SpecserveError("quantization scales out of fp16 range")
        # packed in slices of rows: pack widens to int64, 8x an int8 input (a stack of experts is large)
        rows = max(1, (1 << 24) // max(1, q.shape[1]))
        words = torch.cat([pack(q[r : r + rows].to(torch.int32) + offset, bits, group)
                           for r in range(0, max(1, q.shape[0]), rows)])
        return cls(words, sm, bits, group, hi + offset)


Weight = torch.Tensor | QuantWeight


def pack(u: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Unsigned integers u [N, K] < 2^bits -> int32 words [N, K * bits / 32] (module docstring's layout)."""
    n, k = u.shape
    per = 32 // bits
    fields = u.to(torch.int64).view(n, k // group, per, group // per)  # [n, g, i, j]
    shifts = torch.arange(per, device=u.device, dtype=torch.int64).view(1, 1, per, 1) * bits
    words = (fields << shifts).sum(dim=2)  # fields do not overlap: the sum is a bitwise or
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # as two's-complement int32
    return words.to(torch.int32).reshape(n, k * bits // 32)


def unpack(words: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """int32 words -> the unsigned integers u [N, K] as int32 (inverse of `pack`)."""
    n = words.shape[0]
    per = 32 // bits
    w = words.view(n, -1, 1, group // per)
    shifts = torch.arange(per, device=words.device, dtype=torch.int32).view(1, 1, per, 1) * bits
    return ((w >> shifts) & ((1 << bits) - 1)).reshape(n, -1)


def quantize_q8(w: torch.Tensor, chunk_rows: int = 8192) -> QuantWeight:
    """Q8_0's rule (d = amax / 127, q = round(w / d), d rounded to fp16); a Q8_0 GGUF tensor
    dequantized to fp32 comes back exactly. Chunked so the fp32 temporaries stay small."""
    n, k = w.shape
    if k % Q8_BLOCK:
        raise SpecserveError(f"Q8 weights need an input size divisible by {Q8_BLOCK}, got {k}")
    q = torch.empty((n, k), dtype=torch.int8, device=w.device)
    scale = torch.empty((n, k // Q8_BLOCK), dtype=torch.float32, device=w.device)
    for r in range(0, n, chunk_rows):
        blocks = w[r : r + chunk_rows].float().view(-1, k // Q8_BLOCK, Q8_BLOCK)
        d = (blocks.abs().amax(-1) / 127.0).half().float()
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        q[r : r + chunk_rows] = (blocks * inv[..., None]).round().clamp(-127, 127).to(torch.int8).view(-1, k)
        scale[r : r + chunk_rows] = d
    return QuantWeight.from_ints(q, scale, None, Q8_BLOCK)


def dequantize_ref(w: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """scale * u - min in fp32, then `dtype`."""
    u = unpack(w.words, w.bits, w.group)
    n, k = u.shape
    sm = w.sm.float()
    blocks = u.view(n, k // w.group, w.group).float() * sm[..., 0:1] - sm[..., 1:2]
    return blocks.view(n, k).to(dtype)


def concat_quant(parts: list[QuantWeight]) -> QuantWeight:
    """Stack matrices along N (Q, K, V -> QKV) on the smallest group and the widest integers."""
    group = min(p.group for p in parts)
    bits = max(p.bits for p in parts)
    words = [p.words if (p.group, p.bits) == (group, bits) else pack(unpack(p.words, p.bits, p.group), bits, group)
             for p in parts]
    sm = [p.sm.repeat_interleave(p.group // group, dim=1) for p in parts]
    return QuantWeight(torch.cat(words), torch.cat(sm), bits, group, max(p.u_max for p in parts))


def linear_ref(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None, silu_input: bool = False,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = act(x) @ W^T + bias, act = silu_mul when silu_input (x is then [.., 2K]); y in out_dtype."""
    if silu_input:
        x = silu_mul_ref(x)
    weight = dequantize_ref(w, x.dtype) if isinstance(w, QuantWeight) else w
    y = F.linear(x, weight, bias)
    return y if out_dtype is None else y.to(out_dtype)


def _triton_gemv_float(rows: int) -> bool:
    """One row over a float matrix (SPECSERVE_TRITON_GEMV=0: always cuBLAS, for A/B runs)."""
    return rows == 1 and os.environ.get("SPECSERVE_TRITON_GEMV") != "0"


def _cpu_packed(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None,
                out_dtype: torch.dtype | None) -> torch.Tensor | None:
    """x @ w^T on the CPU's packed-integer kernels, or None where they do not take it (quant_cpu decides, also
    for how many rows)."""
    from specserve.kernels import quant_cpu

    if not quant_cpu.available(x, w):
        return None
    y = quant_cpu.gemv(x, w)
    y = y if bias is None else y + bias
    return y if out_dtype is None else y.to(out_dtype)


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None, silu_input: bool = False,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    quant = isinstance(w, QuantWeight)
    if quant and not silu_input and not x.is_cuda and not triton_enabled(x):  # first: a CPU decode's ~120 products
        y = _cpu_packed(x, w, bias, out_dtype)
        if y is not None:
            return y
    rows = x.numel() // x.shape[-1]
    invariant = batch_invariant.applies(x)
    if quant and (rows <= MAX_SLICED_ROWS or invariant) and triton_enabled(x):
        from specserve.kernels import quant_cuda

        kernel = quant_cuda.usable(x, w, bias, out_dtype or x.dtype)
        if kernel:
            return quant_cuda.gemv(x, w, bias, silu_input, out_dtype or x.dtype, kernel=kernel)
    if invariant:  # one kernel for every row count: float products in fixed slices
        weight = dequantize(w, x.dtype) if quant else w
        y = batch_invariant.linear_float(silu_mul(x) if silu_input else x, weight, bias)
        return y if out_dtype is None else y.to(out_dtype)
    if rows <= MAX_GEMV_ROWS and triton_enabled(x) and (quant or _triton_gemv_float(rows)):
        from specserve.kernels import linear_triton

        return linear_triton.gemv(x, w, bias, silu_input, out_dtype or x.dtype)
    if silu_input:
        x = silu_mul(x)
    if quant and x.device.type == "cpu":
        y = _cpu_packed(x, w, bias, out_dtype)
        if y is not None:
            return y
    weight = dequantize(w, x.dtype) if quant else w
    y = F.linear(x, weight, bias)
    return y if out_dtype is None else y.to(out_dtype)


def fusable(x: torch.Tensor, w: Weight, norm_input: bool = False) -> bool:
    """The tensor-core kernel takes x @ w^T (a decode or verify step over packed weights), and with
    norm_input it can fold in the RMSNorm of x (K staged whole). Such products can also add into a
    residual stream (`linear_fused`) and apply SwiGLU to their output (`feed_forward`)."""
    rows = x.numel() // x.shape[-1]
    if not (isinstance(w, QuantWeight) and (rows <= MAX_SLICED_ROWS or batch_invariant.applies(x))
            and triton_enabled(x)):
        return False
    from specserve.kernels import quant_cuda

    return quant_cuda.usable(x, w, None, x.dtype) == "gemv_mma" and (not norm_input or quant_cuda.norm_fusable(w))


def linear_fused(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None, *,
                 norm: tuple[torch.Tensor, float] | None = None, add_to: torch.Tensor | None = None,
                 rope: RopeWrite | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """linear() on the tensor-core kernel (`fusable` says when) with the RMSNorm of x, norm = (weight,
    eps), folded into its input, and its result added to `add_to` in place (then returned), or, for a
    [q | k | v] matrix, rotated (RoPE) with k and v written to the KV cache and q returned. Same
    roundings as rms_norm, linear, a bf16 addition, rope_and_cache."""
    from specserve.kernels import quant_cuda

    return quant_cuda.gemv(x, w, bias, False, out_dtype or x.dtype, kernel="gemv_mma", norm=norm, add_to=add_to,
                            rope=rope)


def feed_forward(x: torch.Tensor, w_gate_up: Weight, w_down: Weight, *, norm: tuple[torch.Tensor, float] | None = None,
                 add_to: torch.Tensor | None = None) -> torch.Tensor:
    """down(silu(gate) * up) with [gate | up] = x @ w_gate_up^T. Where both products are `fusable`,
    SwiGLU runs in gate_up's output (down then stages plain activations), and norm / add_to fold in as
    in linear_fused; elsewhere SwiGLU runs in down's input (norm and add_to are then not allowed).
    Both ways round gate, up, silu(gate) and the product to bf16 alike: the same values."""
    if fusable(x, w_gate_up, norm is not None) and fusable(x, w_down) and w_gate_up.shape[0] % 16 == 0:
        from specserve.kernels import quant_cuda

        act = quant_cuda.gemv(x, w_gate_up, None, False, x.dtype, kernel="gemv_mma", swiglu_output=True, norm=norm)
        return quant_cuda.gemv(act, w_down, None, False, x.dtype, kernel="gemv_mma", add_to=add_to)
    assert norm is None and add_to is None, "RMSNorm and the residual add fold in only on the tensor-core kernel"
    return linear(linear(x, w_gate_up), w_down, silu_input=True)


def dequantize(w: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    if triton_enabled(w.words):
        from specserve.kernels import linear_triton

        return linear_triton.dequantize(w, dtype)
    return dequantize_ref(w, dtype)


# Decoder-step ops: RMSNorm -> product (+ RoPE and the KV write) -> add to the residual stream. The model
# calls them on a ResidualStream; whether they fold the norms, RoPE and the adds into the products (the
# tensor-core kernel) is decided here, once per step for all of its ops (`StepFusion`).


class ResidualStream:
    """A decoder step's residual stream [rows, hidden], as its ops read it and add to it.

    fused: each op folds the RMSNorm it needs into its product and adds its output in place, so
    `residual` is always current. Otherwise a sub-layer's output waits in `pending` for the next RMSNorm,
    which adds it in the same kernel (add_rms_norm)."""

    def __init__(self, x: torch.Tensor, fused: bool) -> None:
        self.residual = x
        self.pending: torch.Tensor | None = None
        self.fused = fused

    def normed(self, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of the stream, with the pending output added first (unfused ops)."""
        if self.pending is None:
            return rms_norm(self.residual, weight, eps)
        h, self.residual = add_rms_norm(self.pending, self.residual, weight, eps)
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


@dataclass
class NormQKVRope:
    """RMSNorm -> [q | k | v] product (+ bias) -> RMSNorm of each q and k head (head_norms) -> RoPE, with k
    and v written to one layer's KV cache [n_seqs, n_kv_heads, ctx, head_dim]; returns the rotated q
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

    def fusable(self, x: torch.Tensor) -> bool:
        """The epilogue rotates whole heads of a multiple of 16 values and has no per-head RMSNorm."""
        rope_ok = (2 * self.cos.shape[-1] == self.head_dim and self.head_dim % 16 == 0 and self.head_norms is None
                   and self.style in ("neox", "interleaved"))
        return rope_ok and fusable(x, self.w, norm_input=True) and self.norm.dtype == torch.bfloat16

    def __call__(self, stream: ResidualStream, positions: torch.Tensor, seq_ids: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        n = stream.residual.shape[0]
        if stream.fused:
            rope = RopeWrite(self.cos, self.sin, positions, seq_ids, k_cache, v_cache, self.n_heads, self.n_kv_heads,
                             self.style)
            q = linear_fused(stream.residual, self.w, self.bias, norm=(self.norm, self.eps), rope=rope)
            return q.view(n, self.n_heads, self.head_dim)
        qkv = linear(stream.normed(self.norm, self.eps), self.w, self.bias)
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q = qkv[:, :q_size].view(n, self.n_heads, self.head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(n, self.n_kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size :].view(n, self.n_kv_heads, self.head_dim)
        if self.head_norms is not None:
            q = rms_norm(q, self.head_norms[0], self.eps)
            k = rms_norm(k, self.head_norms[1], self.eps)
        return rope_and_cache(q, k, v, self.cos, self.sin, positions, seq_ids, k_cache, v_cache, self.style)


@dataclass
class LinearAdd:
    """stream += x @ w^T: the product that ends a sub-layer (attention's output matrix)."""

    w: Weight

    def fusable(self, x: torch.Tensor) -> bool:
        return fusable(x, self.w)

    def __call__(self, stream: ResidualStream, x: torch.Tensor) -> None:
        if stream.fused:
            linear_fused(x, self.w, add_to=stream.residual)
        else:
            stream.add(linear(x, self.w))


@dataclass
class NormFeedForwardAdd:
    """stream += down(silu(gate) * up) of the stream's RMSNorm (the dense SwiGLU feed-forward)."""

    norm: torch.Tensor
    eps: float
    w_gate_up: Weight
    w_down: Weight

    def fusable(self, x: torch.Tensor) -> bool:
        return (fusable(x, self.w_gate_up, norm_input=True) and fusable(x, self.w_down)
                and self.w_gate_up.shape[0] % 16 == 0 and self.norm.dtype == torch.bfloat16)

    def __call__(self, stream: ResidualStream) -> None:
        if stream.fused:
            feed_forward(stream.residual, self.w_gate_up, self.w_down, norm=(self.norm, self.eps),
                         add_to=stream.residual)
        else:
            stream.add(feed_forward(stream.normed(self.norm, self.eps), self.w_gate_up, self.w_down))


@dataclass
class NormLinear:
    """RMSNorm of the stream -> product, e.g. the output head. It ends the step, so it folds the norm in
    whenever its own product can, on a fused step."""

    norm: torch.Tensor
    eps: float
    w: Weight
    out_dtype: torch.dtype | None = None

    def __call__(self, stream: ResidualStream) -> torch.Tensor:
        if stream.fused and fusable(stream.residual, self.w, norm_input=True):
            return linear_fused(stream.residual, self.w, norm=(self.norm, self.eps), out_dtype=self.out_dtype)
        return linear(stream.normed(self.norm, self.eps), self.w, out_dtype=self.out_dtype)


class StepOp(Protocol):
    def fusable(self, x: torch.Tensor) -> bool:
        """Whether the op can fold its norm and add into its product for a step whose residual stream is x."""
        ...


class StepFusion:
    """Opens each step's ResidualStream, fused only where every op of the step can fuse: then the stream is
    current after every op, else added to by the next RMSNorm; a mix would need separate adds where the two
    meet. Decided once per row count (the step's shapes fix it)."""

    def __init__(self, ops: list[StepOp]) -> None:
        self.ops = ops
        self._by_rows: dict[int, bool] = {}

    def stream(self, x: torch.Tensor) -> ResidualStream:
        rows = x.shape[0]
        if rows not in self._by_rows:
            self._by_rows[rows] = all(op.fusable(x) for op in self.ops)
        return ResidualStream(x, self._by_rows[rows])
