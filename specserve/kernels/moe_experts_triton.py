"""Triton kernels for a mixture of experts over packed expert weights (`QuantExperts`).

Few tokens (decode and verify steps): one program per (token, slot) pair and block of outputs reads the
pair's expert id and then only that expert's packed rows, on CUDA cores with linear_triton's exponent
trick (each bit field read as the float 1 + u / 2^bits). The down projection applies SwiGLU to the
gate|up output as it loads it, and one program sums a token's k slots in slot order, so the weighted
sum needs no atomics and no further pass, and every run sums in the same order. A pair's result does
not depend on the other pairs, so a verify step computes what decode steps compute.

Many tokens (prefill): the pairs are sorted by expert on the device and cut into tiles of BM pairs of
one expert (`schedule`); one program per tile and block of outputs dequantizes that expert's weights once
for the tile's rows and multiplies on tensor cores (a grouped GEMM); a token's slots are then summed in
slot order (`slot_sum`). Neither path reads anything back to the host, so both can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from specserve.kernels.linear_triton import INTERPRET, row_products, tile_products
from specserve.kernels.quant_weight import MAX_SLICED_ROWS

if TYPE_CHECKING:
    from specserve.kernels.quant_experts import QuantExperts

# Up to this many tokens each pair runs on its own (the decode kernels), as the dense path's packed
# products run up to this many rows through the decode-size kernels; more take the grouped GEMM.
MAX_PAIR_TOKENS = MAX_SLICED_ROWS


@triton.jit
def _pairs_gate_up_kernel(x_ptr, ids_ptr, w_ptr, sm_ptr, out_ptr, N, stride_x, K: tl.constexpr,
                          N_SLOTS: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    """out[pair] = x[token] @ W_e^T for pair = token * N_SLOTS + slot and e = ids[pair]; W_e is expert e's
    [N, K] block of the stacked matrix (rows e * N ..), the only weights this program reads."""
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    y = row_products(x_ptr + (pair // N_SLOTS) * stride_x, w_ptr, sm_ptr, expert * N + n, n_mask, K, BITS, G,
                      False, BLOCK_N, BLOCK_K)
    tl.store(out_ptr + pair * N + n, y.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _pairs_down_kernel(act_ptr, ids_ptr, wt_ptr, w_ptr, sm_ptr, out_ptr, N, K: tl.constexpr, N_SLOTS: tl.constexpr,
                       BITS: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[token] = sum over slots, in slot order, of wt[pair] * (silu(gate) * up of act[pair]) @ W_e^T."""
    token = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    acc = tl.zeros([BLOCK_N], tl.float32)
    for slot in tl.static_range(N_SLOTS):  # unrolled: every slot's weight loads in flight at once
        pair = token * N_SLOTS + slot
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        y = row_products(act_ptr + pair * (2 * K), w_ptr, sm_ptr, expert * N + n, n_mask, K, BITS, G, True,
                          BLOCK_N, BLOCK_K)
        # each expert's output rounded to the activation dtype first, as the reference's product is
        acc += tl.load(wt_ptr + pair) * y.to(act_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + token * N + n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _slot_sum_kernel(p_ptr, wt_ptr, out_ptr, N, N_SLOTS: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[token] = sum over slots, in slot order, of wt[pair] * p[pair] (pair = token * N_SLOTS + slot)."""
    token = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    acc = tl.zeros([BLOCK_N], tl.float32)
    for slot in tl.static_range(N_SLOTS):
        pair = token * N_SLOTS + slot
        acc += tl.load(wt_ptr + pair) * tl.load(p_ptr + pair * N + n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * N + n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _grouped_kernel(x_ptr, order_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, w_ptr, sm_ptr, out_ptr, N,
                    stride_x, K: tl.constexpr, N_SLOTS: tl.constexpr, BY_TOKEN: tl.constexpr, SILU_IN: tl.constexpr,
                    BITS: tl.constexpr, G: tl.constexpr, BM: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """out[pair] = x_row(pair) @ W_e^T for the (up to BM) sorted pairs order[start:end] of this tile, all of
    expert e. x_row is the pair's token (BY_TOKEN: the gate|up product) or the pair itself (down). A tile
    whose expert is -1 is past the last one (the grid is sized for the most tiles any routing makes)."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    r = tl.load(tile_start_ptr + tile) + tl.arange(0, BM)
    m_mask = r < tl.load(tile_end_ptr + tile)
    pair = tl.load(order_ptr + r, mask=m_mask, other=0).to(tl.int64)
    x_row = pair // N_SLOTS if BY_TOKEN else pair
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    acc = tl.zeros([BM, BLOCK_N], tl.float32)
    if expert >= 0:
        acc = tile_products(x_ptr, x_row * stride_x, m_mask, w_ptr, sm_ptr, expert * N + n, n_mask, K, BITS, G,
                             SILU_IN, BM, BLOCK_N, BLOCK_K)
    tl.store(out_ptr + pair[:, None] * N + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def _pair_blocks(k: int, bits: int) -> dict[str, int]:
    """Fixed blocks (never timed, so the summation order follows the shape alone): a few output rows per
    program so every SM has work, K in steps of 8 KiB of words or the next power of two above K."""
    if INTERPRET:  # the interpreter runs every program in Python: few, wide ones
        return {"BLOCK_N": 64, "BLOCK_K": 64}
    return {"BLOCK_N": 4 if k <= 4096 else 2, "BLOCK_K": min(8192 // bits, triton.next_power_of_2(k)),
            "num_warps": 4}


def _grouped_blocks(pairs: int, n_expert: int) -> dict[str, int]:
    """Tiles of 16 pairs while experts see few pairs each, 64 when most of a tile would be full (each
    expert's weights are then dequantized a quarter as often)."""
    if INTERPRET:
        return {"BM": 16, "BLOCK_N": 16, "BLOCK_K": 128}
    if pairs >= 64 * n_expert:
        return {"BM": 64, "BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}
    return {"BM": 16, "BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}


def schedule(ids: torch.Tensor, n_expert: int, bm: int) -> tuple[torch.Tensor, ...]:
    """The grouped GEMM's tiles, computed on the device: (order, tile_expert, tile_start, tile_end).

    order: the pairs (token * k + slot) sorted by expert, stably. Expert e's pairs order[seg_start[e]:
    seg_end[e]] are cut into ceil(count / bm) tiles, numbered expert after expert; tile t covers
    order[tile_start[t]:tile_end[t]] of expert tile_expert[t]. The sum of ceil(count / bm) is at most
    (pairs + (experts chosen) * (bm - 1)) / bm, so that many tiles are laid out and the rest get -1."""
    flat = ids.reshape(-1)
    n_pairs = flat.numel()
    sorted_ids, order = torch.sort(flat, stable=True)
    experts = torch.arange(n_expert, device=flat.device, dtype=sorted_ids.dtype)
    seg_start = torch.searchsorted(sorted_ids, experts)
    seg_end = torch.searchsorted(sorted_ids, experts, right=True)
    n_tiles = (seg_end - seg_start + bm - 1) // bm
    tiles_end = torch.cumsum(n_tiles, 0)
    max_tiles = (n_pairs + min(n_expert, n_pairs) * (bm - 1)) // bm
    t = torch.arange(max_tiles, device=flat.device, dtype=tiles_end.dtype)
    owner = torch.searchsorted(tiles_end, t, right=True)  # n_expert: past the last tile
    e = owner.clamp(max=n_expert - 1)
    start = seg_start[e] + (t - (tiles_end[e] - n_tiles[e])) * bm
    end = torch.minimum(start + bm, seg_end[e])
    return order, torch.where(owner < n_expert, owner, -1), start, end


def _check(x: torch.Tensor, gate_up: QuantExperts, down: QuantExperts) -> tuple[int, int, int]:
    n_expert, two_ffn, hidden = gate_up.shape
    assert down.shape == (n_expert, hidden, two_ffn // 2) and x.shape[-1] == hidden, (gate_up.shape, down.shape)
    return n_expert, two_ffn, hidden


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: QuantExperts,
                down: QuantExperts) -> torch.Tensor:
    """moe_experts_ref over packed experts: x [n, hidden], ids [n, k], weights [n, k] -> [n, hidden]."""
    if ids.shape[0] <= MAX_PAIR_TOKENS:
        return pairs(x, ids, weights, gate_up, down)
    return grouped(x, ids, weights, gate_up, down)


def pairs(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: QuantExperts,
          down: QuantExperts) -> torch.Tensor:
    """The few-token path: each (token, slot) pair reads its own expert's rows; the slots summed in-kernel."""
    n_expert, two_ffn, hidden = _check(x, gate_up, down)
    n, k = ids.shape
    x = x.contiguous()
    ids = ids.contiguous()
    weights = weights.float().contiguous()
    act = torch.empty((n * k, two_ffn), dtype=x.dtype, device=x.device)
    cfg = _pair_blocks(hidden, gate_up.w.bits)
    _pairs_gate_up_kernel[(n * k, triton.cdiv(two_ffn, cfg["BLOCK_N"]))](
        x, ids, gate_up.w.words, gate_up.w.sm.view(torch.int32), act, two_ffn, x.stride(0), hidden, k,
        BITS=gate_up.w.bits, G=gate_up.w.group, **cfg)
    out = torch.empty((n, hidden), dtype=x.dtype, device=x.device)
    cfg = _pair_blocks(two_ffn // 2, down.w.bits)
    _pairs_down_kernel[(n, triton.cdiv(hidden, cfg["BLOCK_N"]))](
        act, ids, weights, down.w.words, down.w.sm.view(torch.int32), out, hidden, two_ffn // 2, k,
        BITS=down.w.bits, G=down.w.group, **cfg)
    return out


def grouped(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: QuantExperts,
            down: QuantExperts) -> torch.Tensor:
    """The many-token path: tiles of one expert's pairs through a grouped GEMM, gate|up then down."""
    n_expert, two_ffn, hidden = _check(x, gate_up, down)
    n, k = ids.shape
    x = x.contiguous()
    cfg = _grouped_blocks(n * k, n_expert)
    order, tile_expert, start, end = schedule(ids, n_expert, cfg["BM"])
    tiles = tile_expert.numel()
    act = torch.empty((n * k, two_ffn), dtype=x.dtype, device=x.device)
    _grouped_kernel[(tiles, triton.cdiv(two_ffn, cfg["BLOCK_N"]))](
        x, order, tile_expert, start, end, gate_up.w.words, gate_up.w.sm.view(torch.int32), act, two_ffn,
        x.stride(0), hidden, k, BY_TOKEN=True, SILU_IN=False, BITS=gate_up.w.bits, G=gate_up.w.group, **cfg)
    per_pair = torch.empty((n * k, hidden), dtype=x.dtype, device=x.device)
    _grouped_kernel[(tiles, triton.cdiv(hidden, cfg["BLOCK_N"]))](
        act, order, tile_expert, start, end, down.w.words, down.w.sm.view(torch.int32), per_pair, hidden,
        act.stride(0), two_ffn // 2, k, BY_TOKEN=False, SILU_IN=True, BITS=down.w.bits, G=down.w.group, **cfg)
    return slot_sum(per_pair, weights, x.dtype)


def slot_sum(per_pair: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[n * k, N] pair outputs -> [n, N] in dtype: each token's k slots weighted (weights [n, k]) and summed
    in slot order in fp32, the same order for any n (torch's reductions choose theirs by shape)."""
    n, k = weights.shape
    width = per_pair.shape[1]
    out = torch.empty((n, width), dtype=dtype, device=per_pair.device)
    block = 64 if INTERPRET else 256
    _slot_sum_kernel[(n, triton.cdiv(width, block))](per_pair.contiguous(), weights.float().contiguous(), out, width,
                                                     k, BLOCK_N=block)
    return out
