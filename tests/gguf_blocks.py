"""Raw GGUF blocks for tests: gguf-py quantizes the simple formats; the K-quants, which gguf-py
can only decode, get random bytes with small finite fp16 scales."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize

K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


def raw_blocks(qtype: Q, rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """[rows, bytes per row] of `qtype` blocks for a [rows, cols] tensor."""
    if qtype not in K_QUANTS:
        return quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    block, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // block, type_size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    d_at = type_size - 2 if qtype == Q.Q6_K else 0  # Q6_K keeps d at the end of its block
    blocks[:, :, d_at:d_at + 2] = scale
    if qtype != Q.Q6_K:
        blocks[:, :, 2:4] = scale  # dmin
    return blocks.reshape(rows, -1)
