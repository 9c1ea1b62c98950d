"""Packed experts (QuantExperts), the Triton kernels of moe_experts_triton.py and the CUDA tensor-core pairs
of moe_experts_cuda.py.

The kernels run against moe_experts_ref over the same experts dequantized, on fresh random packed
weights: the few-token path (one program per pair) and the grouped GEMM of prefill, 1..70 tokens, k 1..8,
several expert counts, repeated expert ids. They run on CUDA, or on the CPU under Triton's interpreter
(TRITON_INTERPRET=1), and skip elsewhere; the layout and loader tests run everywhere. A tiny MoE GGUF in
Q4_0 / Q8_0 with --weight-format gguf keeps its experts packed where the kernels run and computes what
the same experts in float compute; on a plain CPU its experts are dequantized at load and the greedy text
is the float runner's. On CUDA, shapes in whole tensor-core steps take the CUDA pairs for few tokens: they
match the reference and the Triton pairs, and a token's row is the same alone or in a batch, bit for bit.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from specserve.engine.generate import generate
from specserve.engine.local_runner import LocalRunner
from specserve.gguf.tokenizer import Tokenizer
from specserve.kernels import settings as kernel_settings
from specserve.kernels.backend import kernels_for
from specserve.kernels.moe_experts import moe_experts_ref
from specserve.kernels.quant_experts import QuantExperts
from specserve.kernels.quant_weight import QuantWeight, dequantize_ref
from specserve.kernels.settings import HAVE_TRITON
from specserve.model.batch import Batch
from tests.moe_gguf import hf_model, quantize_gguf, write_gguf


def moe_experts(x: torch.Tensor, *args: torch.Tensor | QuantExperts) -> torch.Tensor:
    """The experts as a runner on x's device runs them (its kernels, chosen from the switches as they are now)."""
    return kernels_for(x.device).moe_experts(x, *args)  # type: ignore[arg-type]


CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_kernels = pytest.mark.skipif(not (HAVE_TRITON and (CUDA or INTERPRET)),
                                   reason="needs Triton and a CUDA device (or TRITON_INTERPRET=1)")
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="needs Triton")
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32
TOL = 2e-2 if CUDA else 1e-4  # bf16 roundings of gate, up, SwiGLU and each expert's output; fp32 sums

# integer range, group, with mins: the shapes of GGUF's block formats after repacking
FORMATS = {"q4k": (0, 15, 32, True), "q6k": (-32, 31, 16, False), "q8": (-127, 127, 32, False),
           "q4_0": (-8, 7, 32, False)}


def packed_experts(n_expert: int, n: int, k: int, fmt: str, gen: torch.Generator) -> QuantExperts:
    lo, hi, group, with_mins = FORMATS[fmt]
    q = torch.randint(lo, hi + 1, (n_expert * n, k), generator=gen, dtype=torch.int8)
    scale = (0.5 + torch.rand(n_expert * n, k // group, generator=gen)) / (max(hi, -lo) * k**0.5)
    mins = scale * 8 * torch.rand(n_expert * n, k // group, generator=gen) if with_mins else None
    return QuantExperts(QuantWeight.from_ints(q, scale, mins, group), n_expert).to(DEVICE)


def routing(n: int, k: int, n_expert: int, gen: torch.Generator, same: bool = False) -> tuple[torch.Tensor, ...]:
    """k distinct experts per token (all tokens the same ones when `same`) and positive weights."""
    rows = [torch.randperm(n_expert, generator=gen)[:k]] * n if same else [
        torch.randperm(n_expert, generator=gen)[:k] for _ in range(n)]
    return torch.stack(rows).to(DEVICE), torch.rand(n, k, generator=gen).to(DEVICE)


def reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: QuantExperts,
              down: QuantExperts) -> torch.Tensor:
    return moe_experts_ref(x, ids, weights, dequantize_ref(gate_up.w, x.dtype).view(gate_up.shape),
                           dequantize_ref(down.w, x.dtype).view(down.shape))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def case(n: int, k: int, n_expert: int, fmts: tuple[str, str], seed: int, hidden: int = 64, ffn: int = 32,
         same: bool = False) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    gate_up = packed_experts(n_expert, 2 * ffn, hidden, fmts[0], gen)
    down = packed_experts(n_expert, hidden, ffn, fmts[1], gen)
    x = torch.randn(n, hidden, generator=gen).to(DEVICE, DTYPE)
    return (x, *routing(n, k, n_expert, gen, same), gate_up, down)


def test_concat_puts_each_experts_gate_before_its_up() -> None:
    gen = torch.Generator().manual_seed(0)
    gate, up = packed_experts(4, 8, 64, "q4k", gen).to("cpu"), packed_experts(4, 8, 64, "q6k", gen).to("cpu")
    both = QuantExperts.concat([gate, up])
    assert both.shape == (4, 16, 64) and (both.w.bits, both.w.group) == (8, 16)
    want = torch.cat([dequantize_ref(gate.w, torch.float32).view(4, 8, 64),
                      dequantize_ref(up.w, torch.float32).view(4, 8, 64)], dim=1)
    torch.testing.assert_close(dequantize_ref(both.w, torch.float32).view(4, 16, 64), want, rtol=0, atol=0)
    torch.testing.assert_close(dequantize_ref(both.expert(2), torch.float32), want[2], rtol=0, atol=0)


def test_without_triton_packed_experts_run_each_chosen_expert(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without Triton, packed experts run expert by expert: on the CPU on its packed-weight kernels (the exact
    fp32 one here, SPECSERVE_CPU_EXACT=1), elsewhere dequantized per call: the reference's result either way."""
    monkeypatch.setenv("SPECSERVE_NO_TRITON", "1")
    kernel_settings.reload()
    monkeypatch.setenv("SPECSERVE_CPU_EXACT", "1")
    kernel_settings.reload()
    x, ids, weights, gate_up, down = case(5, 2, 8, ("q4k", "q8"), seed=1)
    torch.testing.assert_close(moe_experts(x, ids, weights, gate_up, down), reference(x, ids, weights, gate_up, down),
                               rtol=1e-5, atol=1e-6)


@needs_triton
@pytest.mark.parametrize("n,k,n_expert,same", [(1, 1, 4, False), (40, 3, 8, False), (70, 8, 8, True),
                                               (33, 2, 128, True)])
def test_schedule_covers_every_pair_once(n: int, k: int, n_expert: int, same: bool) -> None:
    from specserve.kernels.moe_experts_triton import schedule

    gen = torch.Generator().manual_seed(n)
    ids = routing(n, k, n_expert, gen, same)[0].cpu()
    for bm in (16, 64):
        order, tile_expert, start, end = schedule(ids, n_expert, bm)
        seen = []
        for e, s, t in zip(tile_expert.tolist(), start.tolist(), end.tolist(), strict=True):
            if e < 0:
                continue
            pairs = order[s:t]
            assert 0 < t - s <= bm and (ids.reshape(-1)[pairs] == e).all()
            seen += pairs.tolist()
        assert sorted(seen) == list(range(n * k))


@needs_kernels
@pytest.mark.parametrize("n,k,n_expert,fmts,same", [
    (1, 1, 4, ("q4k", "q6k"), False),
    (2, 8, 8, ("q8", "q8"), False),  # every expert, both tokens
    (16, 2, 16, ("q4k", "q6k"), False),
    (6, 4, 64, ("q4_0", "q8"), True),  # the same experts for every token
])
def test_few_tokens_match_the_reference(n: int, k: int, n_expert: int, fmts: tuple[str, str], same: bool) -> None:
    x, ids, weights, gate_up, down = case(n, k, n_expert, fmts, seed=n * 100 + k, same=same)
    got = moe_experts(x, ids, weights, gate_up, down)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert rel_err(got, reference(x, ids, weights, gate_up, down)) < TOL


@needs_kernels
def test_grouped_gemm_matches_the_reference() -> None:
    """Prefill sizes take the grouped GEMM (70 tokens); so can few tokens, called directly."""
    from specserve.kernels import moe_experts_triton

    x, ids, weights, gate_up, down = case(70, 2, 4, ("q4k", "q6k"), seed=7)
    assert moe_experts_triton.MAX_PAIR_TOKENS < 70
    assert rel_err(moe_experts(x, ids, weights, gate_up, down), reference(x, ids, weights, gate_up, down)) < TOL
    x, ids, weights, gate_up, down = case(9, 8, 8, ("q8", "q4_0"), seed=8)
    got = moe_experts_triton.grouped(x, ids, weights, gate_up, down)
    assert rel_err(got, reference(x, ids, weights, gate_up, down)) < TOL


@needs_kernels
def test_a_token_computes_the_same_alone_or_in_a_batch() -> None:
    """Each pair runs on its own, so a verify step's rows are what decode steps compute, bit for bit."""
    x, ids, weights, gate_up, down = case(6, 4, 16, ("q4k", "q6k"), seed=3)
    batch = moe_experts(x, ids, weights, gate_up, down)
    alone = moe_experts(x[4:5], ids[4:5], weights[4:5], gate_up, down)
    assert torch.equal(batch[4:5], alone)


@needs_kernels
def test_slot_sum_adds_each_tokens_slots_in_order() -> None:
    from specserve.kernels.moe_experts_triton import slot_sum

    gen = torch.Generator().manual_seed(5)
    per_pair = torch.randn(7 * 4, 300, generator=gen).to(DEVICE)
    weights = torch.rand(7, 4, generator=gen).to(DEVICE)
    got = slot_sum(per_pair, weights, torch.float32)
    want = sum(weights[:, j, None] * per_pair.view(7, 4, -1)[:, j] for j in range(4))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(slot_sum(per_pair[8:12], weights[2:3], torch.float32), got[2:3])


@pytest.mark.skipif(not (HAVE_TRITON and CUDA), reason="needs CUDA")
@pytest.mark.parametrize("fmts", [("q8", "q8"), ("q4k", "q6k"), ("q4_0", "q8")])
@pytest.mark.parametrize("n", [1, 5, 16])
def test_tensor_core_pairs_match_the_reference_and_the_triton_pairs(n: int, fmts: tuple[str, str]) -> None:
    from specserve.kernels import moe_experts_cuda, moe_experts_triton, quant_cuda

    x, ids, weights, gate_up, down = case(n, 8, 32, fmts, seed=n, hidden=512, ffn=256)
    assert quant_cuda.experts_usable(x, gate_up.w, down.w)

    def pairs(rows: slice) -> torch.Tensor:
        return moe_experts_cuda.pairs(x[rows], ids[rows], weights[rows], gate_up.w, down.w, gate_up.n_expert)

    got = pairs(slice(None))
    assert got.dtype == x.dtype and got.shape == x.shape
    assert rel_err(got, reference(x, ids, weights, gate_up, down)) < TOL
    assert rel_err(got, moe_experts_triton.pairs(x, ids, weights, gate_up, down)) < TOL
    assert torch.equal(got[n - 1 :], pairs(slice(n - 1, None)))


@pytest.mark.skipif(not (HAVE_TRITON and CUDA), reason="needs CUDA")
@pytest.mark.parametrize("n", [3, 100])
def test_both_paths_capture_in_a_cuda_graph(n: int) -> None:
    x, ids, weights, gate_up, down = case(n, 8, 128, ("q4k", "q6k"), seed=n, hidden=256, ffn=128)
    eager = moe_experts(x, ids, weights, gate_up, down)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moe_experts(x, ids, weights, gate_up, down)  # compile outside the capture
        with torch.cuda.graph(graph):
            out = moe_experts(x, ids, weights, gate_up, down)
    torch.cuda.current_stream().wait_stream(stream)
    ids.copy_(ids.flip(0))
    graph.replay()
    assert torch.equal(out, moe_experts(x, ids, weights, gate_up, down))
    assert not torch.equal(out, eager)


def q4_experts(name: str) -> GGMLQuantizationType:
    """Q4_0 gate and up experts (4-bit), Q8_0 for the rest (8-bit), as a Q4 file mixes widths."""
    return GGMLQuantizationType.Q4_0 if "gate_exps" in name or "up_exps" in name else GGMLQuantizationType.Q8_0


@pytest.fixture(scope="module")
def q4_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("moe_q4")
    return quantize_gguf(write_gguf(hf_model("qwen3_moe"), directory / "f32.gguf"), directory / "q4.gguf", q4_experts)


PROMPT = [(37 * i + 11) % 256 for i in range(8)]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if CUDA else []))
def test_packed_model_computes_what_float_experts_compute(q4_file: Path, dtype: torch.dtype) -> None:
    """--weight-format gguf keeps the experts packed where the kernels run; the same model with those
    experts dequantized to float (the torch path) gives the same logits, and in fp32 the same greedy text
    (on CUDA, where decode steps are cheap; bf16's roundings could flip a near tie)."""
    packed = LocalRunner(q4_file, n_ctx=64, device=DEVICE, dtype=dtype, progress=False, weight_format="gguf")
    experts = packed.weights.layers[0].experts
    assert isinstance(experts.gate_up, QuantExperts) and (experts.gate_up.w.bits, experts.down.w.bits) == (4, 8)
    layers = [dataclasses.replace(layer, experts=dataclasses.replace(
        layer.experts, gate_up=layer.experts.gate_up.dequantize(dtype), down=layer.experts.down.dequantize(dtype)))
        for layer in packed.weights.layers]
    floats = LocalRunner.from_weights(packed.config, dataclasses.replace(packed.weights, layers=layers), n_ctx=64,
                                      weight_format="gguf")
    batch = Batch()
    batch.add_sequence(PROMPT, 0, 0, "all")
    got, want = packed.forward(batch), floats.forward(batch)
    assert rel_err(got, want) < (2e-2 if dtype == torch.bfloat16 else 1e-4)
    if CUDA:
        tokenizer = Tokenizer.from_gguf(packed.gguf)
        texts = []
        for runner in (packed, floats):
            runner.kv_truncate(0, 0)
            texts.append(generate(runner, tokenizer, PROMPT, 24, ignore_eos=True).tokens)
        assert len(texts[0]) == 24 and (dtype == torch.bfloat16 or texts[0] == texts[1])
    else:
        assert torch.equal(got.argmax(-1), want.argmax(-1))


@needs_kernels
def test_q8_packs_the_experts_where_they_run(q4_file: Path) -> None:
    runner = LocalRunner(q4_file, n_ctx=16, device=DEVICE, progress=False, weight_format="q8")
    experts = runner.weights.layers[0].experts
    assert isinstance(experts.gate_up, QuantExperts) and isinstance(experts.down, QuantExperts)
    assert experts.gate_up.shape == (8, 64, 64) and experts.down.shape == (8, 64, 32)


@pytest.mark.skipif(INTERPRET, reason="the CPU runs the Triton expert kernels here")
def test_on_the_cpu_gguf_experts_and_greedy_text(q4_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU the file's Q4_0 / Q8_0 experts stay packed where its packed-weight kernels run (else they
    dequantize): with the exact products (SPECSERVE_CPU_EXACT=1) greedy text is the float model's over 24 tokens.
    The default int8 products round activations with one scale per 32 (as llama.cpp), which on this 64-wide
    random model moves an expert choice within a few tokens: only its first token is the float model's."""
    packed = LocalRunner(q4_file, n_ctx=64, device="cpu", progress=False, weight_format="gguf")
    plain = LocalRunner(q4_file, n_ctx=64, device="cpu", progress=False, weight_format="float")
    gate_up = packed.weights.layers[0].experts.gate_up
    assert isinstance(gate_up, QuantExperts) if kernels_for("cpu").experts_packed else gate_up.dtype == torch.float32
    tokenizer = Tokenizer.from_gguf(plain.gguf)
    want = generate(plain, tokenizer, PROMPT, 24, ignore_eos=True).tokens
    rounded = generate(packed, tokenizer, PROMPT, 24, ignore_eos=True).tokens
    assert len(rounded) == 24 and rounded[0] == want[0]
    monkeypatch.setenv("SPECSERVE_CPU_EXACT", "1")
    kernel_settings.reload()
    try:
        packed.kv_truncate(0, 0)
        assert generate(packed, tokenizer, PROMPT, 24, ignore_eos=True).tokens == want
    finally:
        monkeypatch.delenv("SPECSERVE_CPU_EXACT")
        kernel_settings.reload()
