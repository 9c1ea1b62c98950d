"""Rotary position embedding, in the two layouts GGUF models use."""

from __future__ import annotations

import torch


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
