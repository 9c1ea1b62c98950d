"""Group-quantized, bit-packed integer matrices: the type the loader, the kernels and the model share.

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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.errors import SpecserveError

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
    dense: torch.Tensor | None = field(default=None, repr=False, compare=False)  # see the module docstring

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
