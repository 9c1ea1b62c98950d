"""A CPU step's small ops as one C call each (cpu/ops.c): RMSNorm (with the residual add), RoPE with the KV-cache
write, attention over the cache, SwiGLU. On a 135M model the torch references spent more time dispatching their
5-15 small ops per call than computing; these are one ctypes call each.

Every row is computed on its own, by the same instructions whatever else is in the batch (attention: each
(token, kv head) pair over its sequence's positions 0..its own), so a row's result is bit for bit the same in a
prompt chunk, a decode step or a verify step, alone or beside other requests. The int8 products
(quant_cpu) need that: their rounding turns a 1e-7 difference in an input into a jump of a rounding step.

`takes(...)` says whether a call qualifies (fp32 CPU tensors in the layouts the C code reads). The op modules
(rmsnorm, rope, attention, activation) dispatch here; SPECSERVE_CPU_KERNEL=0 turns it off with the other CPU
kernels. Elementwise results round as the references do; RMSNorm's mean, attention's sums and the exp add and
round in another order (relative differences ~1e-7).
"""

from __future__ import annotations

import ctypes

import torch

from specserve.kernels.cpu import build
from specserve.kernels.kv_format import packed_format


def _lib() -> ctypes.CDLL:
    """The library, which `takes` (asked before each op) found built."""
    lib = build.library()
    assert lib is not None, "a CPU op without its library: takes(...) was not asked"
    return lib


def takes(*tensors: torch.Tensor) -> bool:
    """fp32 CPU tensors, and the library built."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and build.has("cpu_rms_norm")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    _lib().cpu_rms_norm(x.data_ptr(), None, None, weight.contiguous().data_ptr(), out.data_ptr(),
                         x.numel() // dim, dim, eps)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    x, residual = x.contiguous(), residual.contiguous()
    out, summed = torch.empty_like(x), torch.empty_like(x)
    dim = x.shape[-1]
    _lib().cpu_rms_norm(x.data_ptr(), residual.data_ptr(), summed.data_ptr(),
                         weight.contiguous().data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps)
    return out, summed


def rope_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """q, k, v: [tokens, heads, dim] views with contiguous heads and one row stride (the columns of one [q | k | v]
    product), caches [blocks, heads, block size, dim] with contiguous rows, int64 positions and slots."""
    dim, row = q.shape[-1], q.stride(0)
    views = all(t.stride(2) == 1 and t.stride(1) == dim and (t.stride(0) == row or t.shape[0] == 1) for t in (q, k, v))
    caches = paged(k_cache, v_cache, dim)
    ids = positions.dtype == slots.dtype == torch.int64 and positions.is_contiguous() and slots.is_contiguous()
    return views and caches and ids and takes(q, k, v)


def rope_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   style: str) -> torch.Tensor:
    """rope.rope_and_cache_ref in one call (`rope_takes` first): the rotated q [tokens, heads, dim]."""
    tokens, n_heads, dim = q.shape
    out = torch.empty((tokens, n_heads, dim), dtype=torch.float32)
    cos, sin = cos.contiguous(), sin.contiguous()
    row = q.stride(0) if tokens > 1 else 0  # a view's stride over one row is arbitrary, and unused
    _lib().cpu_rope_cache(q.data_ptr(), k.data_ptr(), v.data_ptr(), row, tokens, n_heads, k.shape[1],
                           dim, cos.shape[-1], cos.data_ptr(), sin.data_ptr(), positions.data_ptr(),
                           slots.data_ptr(), *cache_args(k_cache, dim), *cache_args(v_cache, dim),
                           k_cache.shape[2].bit_length() - 1, style == "neox", out.data_ptr())
    return out


def _row_bits(cache: torch.Tensor, dim: int) -> int | None:
    """0 for fp32 rows of dim values, 16 for fp16 ones, 8 or 4 for packed q8_0 / q4_0 rows (cpu/kv_rows.h), None
    for rows the C code does not read (bf16)."""
    if cache.dtype == torch.float32:  # (first: the default pool, on every call of a step)
        return 0 if cache.shape[3] == dim else None
    if cache.dtype == torch.float16:
        return 16 if cache.shape[3] == dim else None
    fmt = packed_format(cache.shape[3], dim) if cache.dtype == torch.uint8 else None
    return None if fmt is None else fmt.code_bits


def cache_args(cache: torch.Tensor, dim: int) -> tuple[int, int, int, int | None]:
    """(data, block stride, head stride, bits) of a layer's cache, as cpu/ops.c's kv_cache."""
    return cache.data_ptr(), cache.stride(0), cache.stride(1), _row_bits(cache, dim)


def paged(k_cache: torch.Tensor, v_cache: torch.Tensor, dim: int) -> bool:
    """A layer's caches as the C code reads them: [blocks, heads, block size (a power of two), row], contiguous
    CPU tensors of fp32 or fp16 rows of dim values, or packed rows."""
    size = k_cache.shape[2]
    return (k_cache.device.type == "cpu" and k_cache.is_contiguous() and v_cache.is_contiguous()
            and _row_bits(k_cache, dim) is not None and _row_bits(v_cache, dim) is not None
            and k_cache.shape[:3] == v_cache.shape[:3] and size & (size - 1) == 0)


def attention_takes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                    seq_ids: torch.Tensor, table: torch.Tensor) -> bool:
    caches = paged(k_cache, v_cache, q.shape[-1])
    ids = positions.dtype == seq_ids.dtype == torch.int64 and positions.is_contiguous() and seq_ids.is_contiguous()
    heads = q.shape[1] % k_cache.shape[1] == 0 and q.shape[1] // k_cache.shape[1] <= 256  # ops.c's per-group bound
    blocks = table.dtype == torch.int32 and table.is_contiguous() and table.device.type == "cpu"
    return caches and ids and heads and blocks and q.shape[0] > 0 and takes(q)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
              seq_ids: torch.Tensor, table: torch.Tensor, scale: float, hidden: torch.Tensor | None = None
              ) -> torch.Tensor:
    """attention.attention_ref in one call (`attention_takes` first): row t attends to its sequence's
    positions 0..positions[t], found through its row of the block table (less those `hidden` hides: int64,
    contiguous, a token tree's rows)."""
    q = q.contiguous()
    tokens, n_heads, dim = q.shape
    out = torch.empty_like(q)
    if _lib().cpu_attention(q.data_ptr(), tokens, n_heads, k_cache.shape[1], dim, *cache_args(k_cache, dim),
                             *cache_args(v_cache, dim), positions.data_ptr(), seq_ids.data_ptr(),
                             table.data_ptr(), None if hidden is None else hidden.data_ptr(), table.shape[1],
                             k_cache.shape[2].bit_length() - 1, scale, out.data_ptr(),
                             torch.get_num_threads()):
        raise MemoryError("CPU attention could not allocate its scores")
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of a 2-D x (int64 [rows])."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.long)
    _lib().cpu_argmax(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of [gate | up] along the last dimension."""
    gate_up = gate_up.contiguous()
    n = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], n), dtype=torch.float32)
    _lib().cpu_silu_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * n), n)
    return out
