"""Mixture-of-experts routing: router logits [n_tokens, n_expert] -> each token's k expert ids and weights.

One reference covers every variant of spec/moe-routing.md: softmax or sigmoid gating, an expert bias
that steers selection only, top-k with ties to the lower expert id, normalisation by max(sum, clamp), a
scale, and delayed softmax (top-k on the raw logits, then softmax over the k chosen). A runner's kernels
route (`TorchKernels.route`): the fused Triton kernel (moe_routing_triton.py) where it runs and covers the
shape, the reference elsewhere; `Routing` holds one model's choice of variant.

The gate is computed in float64 and rounded once to fp32, and selection runs on those fp32 values. Two
implementations of an fp32 softmax or sigmoid differ in the last bit now and then, which flips the order of
experts whose values are within an ulp; two roundings of a float64 result differ only where it lies within
~1e-16 of a rounding boundary, so the kernel and the reference pick the same ids, ties included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.errors import SpecserveError

GATINGS = ("softmax", "sigmoid")
# The floor under the sum of the chosen weights before dividing by it (llama.cpp's: the smallest normal
# fp16, 2^-14), so a token whose chosen experts all score ~0 does not divide to inf.
NORM_CLAMP = 2.0**-14
# What the fused kernel covers (spec/moe-routing.md): powers of two up to 512 experts and 576; any k.
FUSED_N_EXPERT = frozenset([1 << i for i in range(10)] + [576])
FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def top_k_lower_id(values: torch.Tensor, k: int) -> torch.Tensor:
    """Ids [n, k] of each row's k largest values, largest first; equal values go to the lower id.

    A stable descending sort keeps equal values in id order, which is exactly the tie rule
    (torch.topk leaves the order of equal values unspecified). Adding 0.0 turns -0.0 into +0.0, which a
    radix sort (CUDA's) would otherwise order apart."""
    return torch.sort(values + 0.0, dim=-1, descending=True, stable=True).indices[:, :k]


def check(logits: torch.Tensor, k: int, gating: str, bias: torch.Tensor | None, norm: bool,
           delayed_softmax: bool) -> None:
    if logits.dim() != 2:
        raise SpecserveError(f"router logits must be [n_tokens, n_expert], got shape {tuple(logits.shape)}")
    n_expert = logits.shape[1]
    if not 1 <= k <= n_expert:
        raise SpecserveError(f"cannot route to {k} of {n_expert} experts")
    if gating not in GATINGS:
        raise SpecserveError(f"unknown MoE gating '{gating}' (choose from {', '.join(GATINGS)})")
    if bias is not None and bias.shape != (n_expert,):
        raise SpecserveError(f"expert bias must have shape ({n_expert},), got {tuple(bias.shape)}")
    if delayed_softmax and (gating != "softmax" or norm or bias is not None):
        # The spec defines the bias on gated probabilities, which delayed softmax has none of before selection.
        raise SpecserveError("delayed softmax takes softmax gating, without normalisation or expert bias")


def route_ref(logits: torch.Tensor, k: int, *, gating: str, bias: torch.Tensor | None = None, norm: bool = False,
              clamp: float = NORM_CLAMP, scale: float = 1.0,
              delayed_softmax: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's k experts: ids [n, k] (long, largest weight first, ties to the lower id) and weights
    [n, k] (fp32).

    gating: "softmax" or "sigmoid" over the logits. bias [n_expert]: added to the gated values for
    selection only; the weights are the un-biased gated values. norm: weights divided by max(their sum,
    clamp). scale: weights multiplied by it. delayed_softmax: top-k on the raw logits, then softmax over
    the k chosen (softmax gating, without norm or bias). The gate in float64 rounded once to fp32, the rest in
    fp32; the fused kernel (moe_routing_triton) gives the same ids and weights within fp32 rounding."""
    check(logits, k, gating, bias, norm, delayed_softmax)
    x = logits.float()
    if delayed_softmax:
        ids = top_k_lower_id(x, k)
        weights = torch.softmax(x.gather(1, ids).double(), dim=-1).float()
    else:
        x64 = x.double()
        probs = (torch.softmax(x64, dim=-1) if gating == "softmax" else torch.sigmoid(x64)).float()
        ids = top_k_lower_id(probs if bias is None else probs + bias.float(), k)
        weights = probs.gather(1, ids)  # the un-biased gated values of the chosen experts
        if norm:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=clamp)
    if scale != 1.0:
        weights = weights * scale
    return ids, weights


@dataclass(frozen=True)
class Routing:
    """One model's routing variant: the keyword arguments of `route_ref` (a runner's kernels route by it,
    `TorchKernels.route`)."""

    k: int
    gating: str = "softmax"
    bias: torch.Tensor | None = None
    norm: bool = False
    scale: float = 1.0
    delayed_softmax: bool = False
    clamp: float = NORM_CLAMP
