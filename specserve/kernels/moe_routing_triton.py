"""Triton MoE routing: router logits [n, n_expert] -> each token's k expert ids and weights, one launch.

A program holds BLOCK_T tokens with all their experts in registers. The gate (softmax or sigmoid) runs in
float64 and is rounded once to fp32, as `moe_routing.route_ref` does, so both select on the same fp32
values (the rounding of a float64 result differs between implementations only where it lies within
~1e-16 of a rounding boundary) and agree on every id, exact ties included. Selection is k passes of
argmax over the experts not yet taken: the largest value, the lowest id among equal ones (IEEE equality,
so -0.0 ties +0.0). The chosen experts' weights are then computed again from their logits, read back by
id, which is cheaper than carrying a third reduction through every pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# GATING: softmax then top-k, sigmoid then top-k, or top-k on the raw logits then softmax over the k.
SOFTMAX, SIGMOID, DELAYED = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
# Experts x tokens held by one program: 512 values keep the tile in registers with 2 warps, and a
# 576-expert row (1024 lanes) is one token per program.
TILE = 512


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, ids_ptr, weights_ptr, n_tokens, n_expert, stride_row, k, clamp, scale,
                  GATING: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < n_tokens
    rows64 = rows.to(tl.int64)
    lanes = tl.arange(0, BLOCK_E)
    lane_ok = lanes < n_expert
    ok = row_ok[:, None] & lane_ok[None, :]
    # Rows past the end read zeros (finite arithmetic, nothing stored); lanes past n_expert are -inf.
    x = tl.load(logits_ptr + rows64[:, None] * stride_row + lanes[None, :], mask=ok, other=0.0).to(tl.float32)
    x = tl.where(lane_ok[None, :], x, float("-inf"))

    if GATING == DELAYED:
        key = x
    else:
        x64 = x.to(tl.float64)
        if GATING == SOFTMAX:
            row_max = tl.max(x64, axis=1)
            row_sum = tl.sum(tl.exp(x64 - row_max[:, None]), axis=1)
            gated = (tl.exp(x64 - row_max[:, None]) / row_sum[:, None]).to(tl.float32)
        else:
            gated = (1.0 / (1.0 + tl.exp(-x64))).to(tl.float32)
        key = gated
        if HAS_BIAS:  # selection only: the weights stay the un-biased gated values
            b = tl.load(bias_ptr + lanes, mask=lane_ok, other=0.0)
            key = gated + b[None, :]
    key = tl.where(key != key, float("inf"), key)  # NaN first, as torch.sort orders it

    kcols = tl.arange(0, BLOCK_K)
    chosen = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    alive = ok  # not yet taken (a taken expert may hold -inf like the rest, so a mask, not a sentinel value)
    j = 0
    while j < k:  # (not `for j in range(k)`: Triton's interpreter cannot take a runtime bound there)
        best = tl.max(tl.where(alive, key, float("-inf")), axis=1)
        tied = alive & (key == best[:, None])
        pick = tl.min(tl.where(tied, lanes[None, :], BLOCK_E), axis=1)
        alive = alive & (lanes[None, :] != pick[:, None])
        chosen = tl.where(kcols[None, :] == j, pick[:, None], chosen)
        j += 1

    k_ok = kcols[None, :] < k
    out_ok = row_ok[:, None] & k_ok
    xk = tl.load(logits_ptr + rows64[:, None] * stride_row + chosen, mask=out_ok, other=0.0).to(tl.float32)
    xk64 = xk.to(tl.float64)
    if GATING == DELAYED:
        xk64 = tl.where(k_ok, xk64, float("-inf"))
        ek = tl.exp(xk64 - tl.max(xk64, axis=1)[:, None])
        w = (ek / tl.sum(ek, axis=1)[:, None]).to(tl.float32)
    elif GATING == SOFTMAX:
        w = (tl.exp(xk64 - row_max[:, None]) / row_sum[:, None]).to(tl.float32)
    else:
        w = (1.0 / (1.0 + tl.exp(-xk64))).to(tl.float32)
    w = tl.where(k_ok, w, 0.0)
    if NORM:
        w = w / tl.maximum(tl.sum(w, axis=1), clamp)[:, None]
    w = w * scale

    out = rows64[:, None] * k + kcols[None, :]
    tl.store(ids_ptr + out, chosen.to(tl.int64), mask=out_ok)
    tl.store(weights_ptr + out, w, mask=out_ok)


def route(logits: torch.Tensor, k: int, *, gating: str, bias: torch.Tensor | None, norm: bool, clamp: float,
          scale: float, delayed_softmax: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_routing.route's contract (arguments already checked there): ids [n, k] long, weights [n, k] fp32."""
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    n, n_expert = logits.shape
    ids = torch.empty((n, k), dtype=torch.long, device=logits.device)
    weights = torch.empty((n, k), dtype=torch.float32, device=logits.device)
    if n == 0:
        return ids, weights
    block_e = max(8, triton.next_power_of_2(n_expert))  # (fewer experts: masked lanes, the 8-expert shapes)
    block_t = max(1, TILE // block_e)
    # About 256 values a warp (8 a thread): 2 warps for a 512-value tile, 4 for 576's 1024 lanes.
    num_warps = max(1, min(4, block_t * block_e // 256))
    mode = DELAYED if delayed_softmax else (SOFTMAX if gating == "softmax" else SIGMOID)
    b = bias.to(device=logits.device, dtype=torch.float32).contiguous() if bias is not None else weights
    _route_kernel[(triton.cdiv(n, block_t),)](
        logits, b, ids, weights, n, n_expert, logits.stride(0), k, float(clamp), float(scale),
        GATING=mode.value, HAS_BIAS=bias is not None, NORM=norm, BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_K=max(8, triton.next_power_of_2(k)), num_warps=num_warps)
    return ids, weights
