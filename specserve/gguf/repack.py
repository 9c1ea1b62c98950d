"""GGUF block-quantized tensors as exact integers (q int8, fp32 scale and min per group).

Every block format read here decodes as w = q * scale - min over groups of 16 or 32 weights,
with small integers q. The integers come from gguf's own decoder run on copies of the blocks
whose scales are forged to 1 (and mins to 0), so no bit layout is re-implemented here; the
real scales are read from the block headers. scale * q - min in fp32 is what gguf computes,
so dequantizing the result gives gguf's values bit for bit (tests/test_repack.py). model/weights.py
packs them for the kernels (QuantWeight.from_ints); this layer knows nothing of the kernels.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import Q4_K, dequantize

ONE_F16 = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
ZERO_F16 = np.zeros(2, dtype=np.uint8)
# Q4_K / Q5_K's 12 packed 6-bit (scale, min) pairs with all scales 1 and all mins 0.
UNIT_K_SCALES = np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], dtype=np.uint8)

# type -> (group size, byte offset of d (fp16), byte offset of the fp16 min / dmin or None)
LAYOUT: dict[Q, tuple[int, int, int | None]] = {
    Q.Q8_0: (32, 0, None), Q.Q4_0: (32, 0, None), Q.Q5_0: (32, 0, None),
    Q.Q4_1: (32, 0, 2), Q.Q5_1: (32, 0, 2),
    Q.Q4_K: (32, 0, 2), Q.Q5_K: (32, 0, 2),
    Q.Q6_K: (16, 208, None),
}
REPACKABLE = frozenset(LAYOUT)


class QuantInts(NamedTuple):
    """A matrix W = q * scale - mins per group of `group` consecutive k, the integers exact."""

    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # fp32 [N, K / group]
    mins: torch.Tensor | None  # fp32 [N, K / group]; None for formats without a min
    group: int


def dequantize_blocks(raw: np.ndarray, qtype: Q) -> np.ndarray:
    """gguf's decoder over raw blocks (any shape whose last dimension is whole blocks), as gguf.quants.dequantize
    gives it. gguf decodes 16 rows per call; on rows of a few blocks the calls cost more than the decoding, so
    the bytes are regrouped into long rows first (the values, decoded elementwise, are the same)."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    raw = np.asarray(raw, dtype=np.uint8)
    out_shape = (*raw.shape[:-1], raw.shape[-1] // type_size * block)
    n_blocks = raw.size // type_size
    per_row = next(r for r in (4096, 1024, 256, 64, 16, 4, 1) if n_blocks % r == 0)
    flat = np.ascontiguousarray(raw).reshape(n_blocks // per_row, per_row * type_size)
    return dequantize(flat, qtype).reshape(out_shape)


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, offset:offset + 2]).view(np.float16).astype(np.float32)[:, 0]


def repack(raw: np.ndarray, qtype: Q, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Raw blocks of a [N, K] tensor -> (q int8 [N, K], scale fp32 [N, K/G], min fp32 [N, K/G] or None)."""
    group, d_at, min_at = LAYOUT[qtype]
    block, type_size = GGML_QUANT_SIZES[qtype]
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, type_size)
    n_blocks = blocks.shape[0]
    unit = blocks.copy()
    unit[:, d_at:d_at + 2] = ONE_F16
    if min_at is not None:
        unit[:, min_at:min_at + 2] = ZERO_F16
    d = _f16(blocks, d_at)[:, None]
    mins = None
    if qtype in (Q.Q4_K, Q.Q5_K):  # 8 sub-blocks of 32, each with a 6-bit scale and min
        assert min_at is not None
        packed = blocks[:, 4:16]
        unit[:, 4:16] = UNIT_K_SCALES
        sc, mn = Q4_K.get_scale_min(packed)
        scale = d * sc.astype(np.float32)
        mins = _f16(blocks, min_at)[:, None] * mn.astype(np.float32)
    elif qtype == Q.Q6_K:  # 16 sub-blocks of 16 with int8 scales
        unit[:, 192:208] = 1
        scale = d * blocks[:, 192:208].view(np.int8).astype(np.float32)
    else:  # one scale (and min, stored as +m: w = d * q + m) per 32-block
        scale = d
        if min_at is not None:
            mins = -_f16(blocks, min_at)[:, None]
    q = dequantize_blocks(unit, qtype).reshape(n_blocks, block)
    n, k = shape
    return (np.rint(q).astype(np.int8).reshape(n, k), scale.reshape(n, k // group).astype(np.float32),
            None if mins is None else mins.reshape(n, k // group).astype(np.float32))
