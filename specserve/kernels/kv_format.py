"""How K or V rows are stored in the paged pool (`-ctk` / `-ctv`): a float type, or packed blocks of 32 values
with one fp16 scale each, as llama.cpp's q8_0 and q4_0 (another byte order within a row, and codes taken against
the scale rounded to fp16, so a decoded row encodes back to the same bytes: slot files and the host cache keep
rows decoded).

A packed row of head_dim values is uint8 [codes | scales]: q8_0 holds head_dim int8 codes, q4_0 head_dim / 2
bytes whose low nibble is value j and high nibble value j + head_dim / 2 (so a kernel reads either half of a head
with one shift), then head_dim / 32 fp16 scales. Keeping a row one run of bytes lets the pool's block copies,
tables and kernels' row addressing stay what they are for float rows; only the row width changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from specserve.errors import SpecserveError

GROUP = 32  # values per scale


@dataclass(frozen=True)
class KVFormat:
    name: str
    dtype: torch.dtype | None = None  # float storage (None: the model's compute dtype, or packed)
    code_bits: int = 0  # packed uint8 rows: bits per value

    @property
    def packed(self) -> bool:
        return self.code_bits > 0

    def storage_dtype(self, compute: torch.dtype) -> torch.dtype:
        if self.packed:
            return torch.uint8
        return self.dtype or compute

    def row_width(self, head_dim: int) -> int:
        """Elements of the storage dtype per row of head_dim values."""
        if not self.packed:
            return head_dim
        return head_dim * self.code_bits // 8 + head_dim // GROUP * 2

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., head_dim] -> storage rows [..., row_width] (float formats: a cast)."""
        if not self.packed:
            return x if self.dtype is None else x.to(self.dtype)
        groups = x.float().unflatten(-1, (-1, GROUP))  # [..., n_groups, 32]
        if self.code_bits == 8:
            scale = (groups.abs().amax(-1) / 127).half()
            inv = torch.where(scale == 0, 0.0, 1 / scale.float())
            codes = (groups * inv[..., None]).round().clamp(-127, 127).to(torch.int8).flatten(-2).view(torch.uint8)
        else:  # q4_0: the value of largest magnitude maps to -8, codes 0..15 around 8
            picked = groups.gather(-1, groups.abs().argmax(-1, keepdim=True)).squeeze(-1)
            scale = (picked / -8 + 0.0).half()  # (+ 0.0: an all-zero group's scale is +0, never -0)
            inv = torch.where(scale == 0, 0.0, 1 / scale.float())
            q = (groups * inv[..., None] + 8.5).floor().clamp(0, 15).to(torch.uint8).flatten(-2)
            half = q.shape[-1] // 2
            codes = q[..., :half] | (q[..., half:] << 4)
        return torch.cat((codes, scale.contiguous().view(torch.uint8)), dim=-1)

    def decode(self, rows: torch.Tensor, head_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Storage rows [..., row_width] -> values [..., head_dim] in dtype."""
        if not self.packed:
            return rows.to(dtype)
        n_code = head_dim * self.code_bits // 8
        scale = rows[..., n_code:].contiguous().view(torch.float16).float()  # [..., n_groups]
        codes = rows[..., :n_code]
        if self.code_bits == 8:
            values = codes.contiguous().view(torch.int8).float()
        else:
            values = torch.cat((codes & 15, codes >> 4), dim=-1).float() - 8
        return (values.unflatten(-1, (-1, GROUP)) * scale[..., None]).flatten(-2).to(dtype)


FORMATS = {f.name: f for f in (KVFormat("f32", torch.float32), KVFormat("f16", torch.float16),
                               KVFormat("bf16", torch.bfloat16), KVFormat("q8_0", code_bits=8),
                               KVFormat("q4_0", code_bits=4))}
COMPUTE = KVFormat("compute")  # the default: rows in the model's compute dtype


def kv_format(name: str | None) -> KVFormat:
    """The format a `-ctk`/`-ctv` value names; None (the flag left out): the model's compute dtype."""
    if name is None:
        return COMPUTE
    if name not in FORMATS:
        raise SpecserveError(f"unknown KV cache type {name!r}; one of {', '.join(FORMATS)}")
    return FORMATS[name]


KVTypes = tuple[str | None, str | None]  # the names -ctk and -ctv give (None: the compute dtype)


def kv_formats(types: KVTypes, head_dim: int) -> tuple[KVFormat, KVFormat]:
    """The K and V formats of a model with heads of head_dim values; a one-line error for a name or head size
    they do not take."""
    k, v = kv_format(types[0]), kv_format(types[1])
    for fmt in (k, v):
        if fmt.packed and head_dim % GROUP:
            raise SpecserveError(f"KV cache type {fmt.name} needs a head size that is a multiple of {GROUP}; "
                                 f"this model's is {head_dim}")
    return k, v


@cache
def packed_format(width: int, head_dim: int) -> KVFormat | None:
    """The packed format whose rows of head_dim values are `width` bytes (q8_0 and q4_0 rows differ in width)."""
    return next((f for f in FORMATS.values() if f.packed and f.row_width(head_dim) == width), None)


def format_of(cache: torch.Tensor, head_dim: int) -> KVFormat:
    """The format of a pool (or one layer of it) holding rows of head_dim values: packed pools are uint8."""
    if cache.dtype != torch.uint8:
        return COMPUTE
    found = packed_format(cache.shape[-1], head_dim)
    if found is None:
        raise ValueError(f"a uint8 cache of {cache.shape[-1]}-byte rows holds no packed format of {head_dim} values")
    return found


def store_rows(cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor) -> None:
    """Write values [rows, heads, head_dim] at (block, offset) of one layer's cache [blocks, heads, size, row]."""
    cache[blocks, :, offsets] = format_of(cache, values.shape[-1]).encode(values).to(cache.dtype)
