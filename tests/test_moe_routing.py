"""MoE routing (kernels.moe_routing) against an independent numpy selection and HF transformers' routers,
and the fused Triton kernel (kernels.moe_routing_triton) against the torch reference.

`route` is checked against `route_ref` on every shape the spec lists: on the CPU both are the reference
(unless TRITON_INTERPRET=1 puts the kernel under Triton's interpreter), on a GPU `route` runs the kernel.
The kernel tests call it directly; they run on CUDA, or on the CPU under the interpreter where Triton is
installed (slow there: few and small cases, 4096 tokens only on the GPU), and skip elsewhere.
"""

from __future__ import annotations

import os
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from specserve.errors import SpecserveError
from specserve.kernels import moe_routing
from specserve.kernels.backend import kernels_for
from specserve.kernels.moe_routing import NORM_CLAMP, Routing, route_ref
from specserve.kernels.settings import HAVE_TRITON, KernelSettings
from specserve.kernels.torch_kernels import TorchKernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"  # route() runs the kernel slowly
KERNEL = HAVE_TRITON and (DEVICE == "cuda" or INTERPRETED)
needs_kernel = pytest.mark.skipif(not KERNEL, reason="needs Triton and a CUDA device (or TRITON_INTERPRET=1)")


def route(logits: torch.Tensor, k: int, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing as a runner on the logits' device routes (its kernels)."""
    return kernels_for(logits.device).route(logits, Routing(k, **kw))


HIDDEN = 32
VARIANTS = {  # spec/moe-routing.md's variants as route's keyword arguments ("bias": a random expert bias)
    "softmax": dict(gating="softmax"),
    "softmax_norm": dict(gating="softmax", norm=True),
    "sigmoid_scale": dict(gating="sigmoid", scale=2.5),
    "sigmoid_bias_norm_scale": dict(gating="sigmoid", bias=True, norm=True, scale=2.5),
    "delayed_softmax": dict(gating="softmax", delayed_softmax=True),
}
# n_expert: the powers of two 8..512 and 576; k 1..8; 1 to 4096 tokens (one size per n_expert, all sizes covered)
SHAPES = [(8, 1, 1), (8, 8, 5), (16, 2, 4096), (32, 3, 37), (64, 4, 1), (128, 8, 4096), (256, 5, 37),
          (512, 6, 1), (576, 7, 4096), (576, 8, 3)]
N_EXPERTS = [8, 16, 32, 64, 128, 256, 512, 576]


def expected(logits: torch.Tensor, k: int, bias: torch.Tensor | None, **kw) -> tuple[np.ndarray, np.ndarray]:
    """The spec's routing in numpy: the gate in float64 rounded once to fp32 (as route_ref computes it),
    selection by lexsort on (-value, id), the weight arithmetic in float64."""
    x = logits.float().cpu().numpy().astype(np.float64)
    with np.errstate(over="ignore"):  # sigmoid of a very negative logit: exp overflows to inf, 1 / inf = 0
        if kw.get("delayed_softmax"):
            gated = x.astype(np.float32)
        elif kw["gating"] == "softmax":
            e = np.exp(x - x.max(1, keepdims=True))
            gated = (e / e.sum(1, keepdims=True)).astype(np.float32)
        else:
            gated = (1 / (1 + np.exp(-x))).astype(np.float32)
    choice = gated if bias is None else gated + bias.float().cpu().numpy()
    ids_col = np.broadcast_to(np.arange(choice.shape[1]), choice.shape)
    ids = np.lexsort((ids_col, -choice), axis=-1)[:, :k]
    w = np.take_along_axis(gated.astype(np.float64), ids, axis=1)
    if kw.get("delayed_softmax"):
        w = np.exp(w - w.max(1, keepdims=True))
        w /= w.sum(1, keepdims=True)
    if kw.get("norm"):
        w /= np.maximum(w.sum(1, keepdims=True), 2.0**-14)
    return ids, w * kw.get("scale", 1.0)


def make_inputs(n: int, n_expert: int, variant: str, ties: bool, seed: int) -> tuple[torch.Tensor, dict]:
    """Logits (ties: small integers, so most values tie exactly) and route's keyword arguments."""
    gen = torch.Generator().manual_seed(seed)
    if ties:  # each value times a random sign: zeros are +0.0 or -0.0, which tie
        sign = torch.randint(0, 2, (n, n_expert), generator=gen) * 2 - 1
        logits = torch.randint(-2, 3, (n, n_expert), generator=gen).float() * sign
    else:
        logits = torch.randn(n, n_expert, generator=gen) * 3
    kw = dict(VARIANTS[variant])
    if kw.pop("bias", False):  # on ties, multiples of 1/4: sums with tied gated values tie too
        bias = torch.randint(-2, 3, (n_expert,), generator=gen) / 4 if ties else torch.randn(n_expert, generator=gen)
        kw["bias"] = bias.to(DEVICE)
    return logits.to(DEVICE), kw


def check(logits: torch.Tensor, k: int, kw: dict) -> None:
    ids, weights = route(logits, k, **kw)
    assert ids.dtype == torch.long and weights.dtype == torch.float32 and ids.shape == weights.shape == (len(logits), k)
    ref_ids, ref_weights = route_ref(logits, k, **kw)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=0)
    want_ids, want_weights = expected(logits, k, **kw)
    np.testing.assert_array_equal(ref_ids.cpu().numpy(), want_ids)
    np.testing.assert_allclose(ref_weights.cpu().numpy(), want_weights, rtol=1e-5, atol=1e-30)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("n_expert,k,n_tokens", SHAPES)
def test_route_shapes(variant: str, n_expert: int, k: int, n_tokens: int) -> None:
    if INTERPRETED and n_tokens > 64:
        pytest.skip("4096 tokens through the interpreter take minutes (the GPU runs them)")
    logits, kw = make_inputs(n_tokens, n_expert, variant, ties=False, seed=n_expert + k)
    kw.setdefault("bias", None)
    check(logits, k, kw)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("n_expert,k", [(8, 2), (64, 8), (576, 5)])
def test_exact_ties_go_to_the_lower_id(variant: str, n_expert: int, k: int) -> None:
    logits, kw = make_inputs(24 if INTERPRETED else 300, n_expert, variant, ties=True, seed=k)
    kw.setdefault("bias", None)
    check(logits, k, kw)
    # All experts equal: the first k ids, in order, whatever the variant.
    ids, _ = route(torch.zeros(3, n_expert, device=DEVICE), k, **{**kw, "bias": None})
    assert ids.tolist() == [list(range(k))] * 3


def test_signed_zeros_tie() -> None:
    logits = torch.tensor([[0.0, -0.0, 0.0, -0.0, -1.0]], device=DEVICE)
    ids, weights = route(logits, 4, gating="softmax", delayed_softmax=True)
    assert ids.tolist() == [[0, 1, 2, 3]]
    torch.testing.assert_close(weights, torch.full((1, 4), 0.25, device=DEVICE))


def test_norm_clamps_the_sum() -> None:
    logits = torch.full((2, 8), -30.0, device=DEVICE)  # sigmoid ~1e-13 each: the sum is below the clamp
    _, weights = route(logits, 2, gating="sigmoid", norm=True, clamp=1e-3)
    torch.testing.assert_close(weights, torch.sigmoid(logits[:, :2]) / 1e-3)


@pytest.mark.parametrize("kw,message", [
    (dict(gating="relu"), "unknown MoE gating"),
    (dict(gating="sigmoid", delayed_softmax=True), "delayed softmax"),
    (dict(gating="softmax", norm=True, delayed_softmax=True), "delayed softmax"),
    (dict(gating="softmax", bias=torch.zeros(8), delayed_softmax=True), "delayed softmax"),
    (dict(gating="softmax", bias=torch.zeros(7)), "expert bias"),
])
def test_bad_variants_are_refused(kw: dict, message: str) -> None:
    with pytest.raises(SpecserveError, match=message):
        route(torch.zeros(2, 8), 2, **kw)
    with pytest.raises(SpecserveError, match="cannot route"):
        route(torch.zeros(2, 8), 9, gating="softmax")


# -- against HF transformers' own routers, built with random weights ------------------------------------------


def hf_router(name: str, n_expert: int, k: int):
    """(router module with random weights, its logits function, our Routing) for one HF router class."""
    pytest.importorskip("transformers")
    from transformers import DeepseekV3Config, GptOssConfig, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    common = dict(hidden_size=HIDDEN, num_experts_per_tok=k)
    if name.startswith(("qwen3", "qwen2")):
        norm = name.endswith("_norm")
        config_cls, router_cls = (Qwen3MoeConfig, Qwen3MoeTopKRouter) if name.startswith("qwen3") else (
            Qwen2MoeConfig, Qwen2MoeTopKRouter)
        router = router_cls(config_cls(**common, num_experts=n_expert, norm_topk_prob=norm))
        routing = Routing(k, "softmax", norm=norm)
    elif name == "mixtral":
        router = MixtralTopKRouter(MixtralConfig(**common, num_local_experts=n_expert))
        routing = Routing(k, "softmax", norm=True)
    elif name.startswith("deepseek_v3"):
        # One group, chosen whole (n_group=1, topk_group=1): HF's group-limited selection then admits every
        # expert, which is the spec's plain top-k; groups with topk_group < n_group are outside the spec.
        norm = name.endswith("_norm")
        router = DeepseekV3TopkRouter(DeepseekV3Config(**common, n_routed_experts=n_expert, n_group=1, topk_group=1,
                                                       norm_topk_prob=norm, routed_scaling_factor=2.5))
        with torch.no_grad():
            router.e_score_correction_bias.copy_(torch.randn(n_expert) * 0.5)
        routing = Routing(k, "sigmoid", bias=router.e_score_correction_bias, norm=norm, scale=2.5)
    else:
        router = GptOssTopKRouter(GptOssConfig(**common, num_local_experts=n_expert))
        with torch.no_grad():
            router.bias.copy_(torch.randn(n_expert))
        routing = Routing(k, "softmax", delayed_softmax=True)
    with torch.no_grad():
        router.weight.copy_(torch.randn(n_expert, HIDDEN))

    def logits(h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, router.weight, getattr(router, "bias", None))

    return router, logits, routing


HF_ROUTERS = ["qwen3", "qwen3_norm", "qwen2", "qwen2_norm", "mixtral", "deepseek_v3", "deepseek_v3_norm", "gpt_oss"]


@pytest.mark.parametrize("name", HF_ROUTERS)
@pytest.mark.parametrize("n_expert,k", [(8, 2), (64, 8), (128, 1), (576, 6)])
def test_against_hf_router(name: str, n_expert: int, k: int) -> None:
    torch.manual_seed(n_expert + k)
    router, logits_of, routing = hf_router(name, n_expert, k)
    h = torch.randn(65, HIDDEN)
    with torch.no_grad():
        _, hf_weights, hf_ids = router(h)
        ids, weights = kernels_for(DEVICE).route(logits_of(h), routing)
    if name.startswith("deepseek_v3"):  # HF's topk(sorted=False): compare each token's experts in id order
        hf_ids, order = hf_ids.sort(dim=1)
        hf_weights = hf_weights.gather(1, order)
        ids, order = ids.sort(dim=1)
        weights = weights.gather(1, order)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights.float(), rtol=1e-5, atol=0)


# -- the fused Triton kernel against the reference -------------------------------------------------------------

KERNEL_TOKENS = [1, 7, 64, 4096]
KERNEL_K = range(1, 9) if DEVICE == "cuda" else (1, 3, 8)  # (the interpreter: each k is another run)


def check_kernel(logits: torch.Tensor, k: int, kw: dict) -> None:
    """The kernel's ids equal the reference's; its weights within fp32 rounding."""
    from specserve.kernels import moe_routing_triton

    full = dict(bias=None, norm=False, clamp=NORM_CLAMP, scale=1.0, delayed_softmax=False) | kw
    ids, weights = moe_routing_triton.route(logits, k, **full)
    ref_ids, ref_weights = route_ref(logits, k, **full)
    assert ids.dtype == torch.long and weights.dtype == torch.float32 and ids.shape == weights.shape == (len(logits), k)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-30)


@needs_kernel
@pytest.mark.parametrize("n_tokens", KERNEL_TOKENS)
@pytest.mark.parametrize("n_expert", N_EXPERTS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kernel_matches_reference(variant: str, n_expert: int, n_tokens: int) -> None:
    if n_tokens > 64 and DEVICE != "cuda":
        pytest.skip("4096 tokens through the interpreter take minutes (the GPU runs them)")
    for k in KERNEL_K:
        logits, kw = make_inputs(n_tokens, n_expert, variant, ties=False, seed=1000 * n_expert + 10 * k + n_tokens)
        check_kernel(logits, k, kw)


@needs_kernel
@pytest.mark.parametrize("n_expert,k", [(8, 2), (64, 8), (576, 5)])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kernel_exact_ties_and_signed_zeros(variant: str, n_expert: int, k: int) -> None:
    logits, kw = make_inputs(24 if DEVICE == "cpu" else 512, n_expert, variant, ties=True, seed=7 * k)
    check_kernel(logits, k, kw)
    check_kernel(torch.zeros(3, n_expert, device=DEVICE), k, {**kw, "bias": None})  # all tied: ids 0..k-1


@needs_kernel
@pytest.mark.parametrize("kw", [
    dict(gating="softmax", bias=True),  # combinations the model families do not use, but the spec allows
    dict(gating="softmax", bias=True, norm=True, scale=0.5),
    dict(gating="sigmoid"),
    dict(gating="sigmoid", norm=True),
    dict(gating="sigmoid", bias=True),
    dict(gating="softmax", delayed_softmax=True, scale=3.0),
], ids=lambda kw: "_".join(f"{k}={v}" for k, v in kw.items()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_combinations_and_input_dtypes(kw: dict, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    for n_expert, k in ((32, 4), (256, 8)):
        logits = (torch.randn(9, n_expert, generator=gen) * 3).to(DEVICE, dtype)
        bias = torch.randn(n_expert, generator=gen).to(DEVICE) if kw.get("bias") else None
        check_kernel(logits, k, {**kw, "bias": bias})


@needs_kernel
@pytest.mark.parametrize("n_expert,k", [(8, 8), (64, 17), (128, 32), (576, 576 if DEVICE == "cuda" else 40)])
def test_kernel_more_than_eight_experts_used(n_expert: int, k: int) -> None:
    for variant in ("softmax_norm", "sigmoid_bias_norm_scale", "delayed_softmax"):
        logits, kw = make_inputs(5, n_expert, variant, ties=False, seed=k)
        check_kernel(logits, k, kw)


@needs_kernel
@pytest.mark.parametrize("n_expert", [1, 2, 4])
def test_kernel_fewer_than_eight_experts(n_expert: int) -> None:
    for variant in VARIANTS:
        for k in range(1, n_expert + 1):
            logits, kw = make_inputs(9, n_expert, variant, ties=False, seed=k)
            check_kernel(logits, k, kw)
            logits, kw = make_inputs(9, n_expert, variant, ties=True, seed=k)
            check_kernel(logits, k, kw)


@needs_kernel
def test_kernel_edge_inputs() -> None:
    # Strided rows (a slice of wider logits), no tokens, and sigmoid of logits whose gate is subnormal or zero.
    wide = torch.randn(6, 200, device=DEVICE) * 3
    check_kernel(wide[:, 10:138], 4, dict(gating="softmax", norm=True))
    check_kernel(torch.empty(0, 64, device=DEVICE), 3, dict(gating="softmax"))
    tiny = -88.0 - 20 * torch.rand(16, 64, generator=torch.Generator().manual_seed(1))  # sigmoid < 2^-126
    check_kernel(tiny.to(DEVICE), 6, dict(gating="sigmoid"))
    check_kernel(tiny.to(DEVICE), 6, dict(gating="sigmoid", norm=True, clamp=1e-3))
    neg_inf = torch.full((2, 16), float("-inf"), device=DEVICE)
    neg_inf[0, 5] = 1.0
    check_kernel(neg_inf[:1], 3, dict(gating="softmax", delayed_softmax=True, scale=1.0))  # -inf ties: lower ids


@needs_kernel
def test_route_dispatch() -> None:
    """A runner's kernels route on the kernel where it covers the call, the reference elsewhere (callers never
    choose)."""
    from specserve.kernels import moe_routing_triton

    def calls(logits: torch.Tensor, kernels: TorchKernels | None = None, **kw) -> int:
        with mock.patch.object(moe_routing_triton, "route", wraps=moe_routing_triton.route) as spy:
            (kernels or kernels_for(DEVICE)).route(logits, Routing(2, "softmax", **kw))
        return spy.call_count

    assert calls(torch.randn(3, 64, device=DEVICE)) == 1
    assert calls(torch.randn(3, 64, device=DEVICE, dtype=torch.bfloat16)) == 1
    assert calls(torch.randn(3, 576, device=DEVICE), norm=True) == 1
    assert calls(torch.randn(3, 60, device=DEVICE)) == 0  # not a shape of the spec: the reference
    assert calls(torch.randn(3, 64, device=DEVICE, dtype=torch.float64)) == 0
    no_triton = kernels_for(DEVICE, kernel_settings=KernelSettings.from_env({"SPECSERVE_NO_TRITON": "1"}))
    assert calls(torch.randn(3, 64, device=DEVICE), no_triton) == 0
    assert sorted(moe_routing.FUSED_N_EXPERT) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 576]


@pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="needs CUDA")
def test_kernel_in_a_cuda_graph() -> None:
    """The model's decode steps are CUDA graphs: the kernel is captured and replays on new logits."""
    logits = torch.randn(16, 128, device="cuda")
    routing = Routing(8, "softmax", norm=True)
    kernels = kernels_for("cuda")
    kernels.route(logits, routing)  # (compiled outside the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, weights = kernels.route(logits, routing)
    logits.copy_(torch.randn(16, 128, device="cuda"))
    graph.replay()
    ref_ids, ref_weights = route_ref(logits, 8, gating="softmax", norm=True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=0)
