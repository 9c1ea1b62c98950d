"""Rotary position embedding (both GGUF layouts), fused with the KV-cache write."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from specserve.kernels.kv_format import store_rows


def rope_cos_sin(rope_dim: int, base: float, max_pos: int, scale: float = 1.0,
                 device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 tables [max_pos, rope_dim // 2] of cos and sin of pos * base^(-2i/rope_dim)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim))
    pos = torch.arange(max_pos, dtype=torch.float64) / scale
    angles = torch.outer(pos, inv_freq)
    return angles.cos().float().to(device), angles.sin().float().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """Rotate x [tokens, heads, head_dim] by per-token cos/sin [tokens, rope_dim // 2].

    style "neox" pairs element i with i + rope_dim/2; "interleaved" pairs 2i with 2i+1.
    Dimensions past rope_dim pass through unchanged.
    """
    half = cos.shape[-1]
    rope_dim = 2 * half
    xf = x[..., :rope_dim].float()
    c = cos[:, None, :]
    s = sin[:, None, :]
    if style == "neox":
        x1, x2 = xf[..., :half], xf[..., half:]
        rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    else:
        pairs = xf.unflatten(-1, (half, 2))
        x1, x2 = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    if rope_dim == x.shape[-1]:
        return rotated.to(x.dtype)
    return torch.cat((rotated.to(x.dtype), x[..., rope_dim:]), dim=-1)


def rope_and_cache_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
    positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, style: str,
) -> torch.Tensor:
    """Rotate q and k [tokens, heads, dim], store k and v at each token's pool slot; return rotated q.

    Caches are [n_blocks, n_kv_heads, block_size, head_dim] (one layer of model/kv_cache.py's pool).
    """
    cos, sin = cos_table[positions], sin_table[positions]
    size = k_cache.shape[2]
    blocks, offsets = torch.div(slots, size, rounding_mode="floor"), slots % size
    store_rows(k_cache, blocks, offsets, apply_rope(k, cos, sin, style))
    store_rows(v_cache, blocks, offsets, v)
    return apply_rope(q, cos, sin, style)


@dataclass
class RopeWrite:
    """RoPE and the KV-cache write folded into a [q | k | v] product's epilogue (see step_ops.linear_fused)."""

    cos: torch.Tensor  # fp32 [max positions, head_dim / 2] (rope_cos_sin, rotating the whole head)
    sin: torch.Tensor
    positions: torch.Tensor  # long [rows]
    slots: torch.Tensor  # long [rows]: where each row's k and v go
    k_cache: torch.Tensor  # one layer's [n_blocks, n_kv_heads, block_size, head_dim]
    v_cache: torch.Tensor
    n_heads: int
    n_kv_heads: int
    style: str  # "neox" or "interleaved"

    @property
    def head_dim(self) -> int:
        return self.k_cache.shape[-1]

    def rows(self, start: int, end: int) -> RopeWrite:
        return dataclasses.replace(self, positions=self.positions[start:end], slots=self.slots[start:end])

    def args(self) -> list:
        c = self.k_cache
        return [self.positions, self.slots, self.cos, self.sin, c, self.v_cache, self.n_heads, self.n_kv_heads,
                c.stride(0), c.stride(1), c.shape[2].bit_length() - 1]
