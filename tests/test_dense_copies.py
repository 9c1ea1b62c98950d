"""Dense copies of packed matrices (kernels.linear's QuantWeight.dense): which products use them, what the
loader gives them, and that a runner's answers do not change where they are used."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from specserve.kernels import settings as kernel_settings
from specserve.kernels.backend import kernels_for
from specserve.kernels.linear import DENSE_MIN_ROWS, dense_copy
from specserve.kernels.quant_weight import MAX_GEMV_ROWS, quantize_q8
from specserve.model.random_init import SHAPES, random_weights
from specserve.model.weights import MATRICES, add_dense_copies, quantize_weights

CUDA = torch.cuda.is_available()


def small_config():
    return dataclasses.replace(SHAPES["qwen2.5-coder-0.5b"], n_layers=2, hidden=256, n_heads=4, n_kv_heads=2,
                               head_dim=64, ffn=512, vocab_size=300)


def test_only_steps_longer_than_one_sequences_take_the_copy() -> None:
    torch.manual_seed(0)
    w = quantize_q8(torch.randn(96, 256))
    x = torch.randn(40, 256)
    assert dense_copy(x, w) is None  # no copy made
    cpu = kernels_for("cpu")
    w.dense = cpu.dequantize(w, torch.float32)
    assert DENSE_MIN_ROWS == MAX_GEMV_ROWS + 1  # a verify step of one sequence never reaches it
    assert dense_copy(x[:MAX_GEMV_ROWS], w) is None
    assert dense_copy(x[:DENSE_MIN_ROWS], w) is w.dense
    assert dense_copy(x.bfloat16(), w) is None  # a copy in another dtype is not used
    assert dense_copy(x, w, invariant=True) is None  # batch-invariant steps keep the packed kernel


def test_the_loader_gives_every_dense_matrix_a_copy_within_its_budget() -> None:
    cfg = small_config()
    weights = quantize_weights(random_weights(cfg, torch.float32, "cpu", seed=3), "q8")
    packed = [getattr(layer, name) for layer in weights.layers for name in MATRICES] + [weights.output]
    need = sum(w.shape.numel() for w in packed) * 4
    cpu = kernels_for("cpu")
    assert add_dense_copies(weights, torch.float32, need - 1, cpu) == 0
    assert all(w.dense is None for w in packed)
    assert add_dense_copies(weights, torch.float32, need, cpu) == need
    for w in packed:
        torch.testing.assert_close(w.dense, cpu.dequantize(w, torch.float32), rtol=0, atol=0)


def test_float_weights_get_no_copies() -> None:
    weights = random_weights(small_config(), torch.float32, "cpu", seed=4)
    assert add_dense_copies(weights, torch.float32, 1 << 40, kernels_for("cpu")) == 0


def test_a_cpu_runner_makes_none() -> None:
    from specserve.engine.local_runner import LocalRunner

    cfg = small_config()
    runner = LocalRunner.from_weights(cfg, random_weights(cfg, torch.float32, "cpu", seed=5), n_ctx=256,
                                      weight_format="q8")
    assert all(layer.wqkv.dense is None for layer in runner.weights.layers)


@pytest.mark.skipif(not CUDA, reason="the packed CUDA kernels: GPU only")
def test_cuda_products_take_the_packed_kernel_up_to_one_sequences_rows() -> None:
    """Up to MAX_GEMV_ROWS rows the packed kernel's bits whether or not a copy exists; more rows cuBLAS over
    the copy; batch-invariant steps the packed kernel at any row count."""
    torch.manual_seed(1)
    w = quantize_q8(torch.randn(512, 1536, device="cuda").bfloat16())
    x = torch.randn(48, 1536, device="cuda").bfloat16()
    kernels = kernels_for("cuda", invariant=False)
    linear = kernels.linear
    packed = {rows: linear(x[:rows], w) for rows in (1, MAX_GEMV_ROWS, 17, 48)}
    w.dense = kernels.dequantize(w, torch.bfloat16)
    for rows in (1, MAX_GEMV_ROWS):
        torch.testing.assert_close(linear(x[:rows], w), packed[rows], rtol=0, atol=0)
    for rows in (17, 48):
        torch.testing.assert_close(linear(x[:rows], w), F.linear(x[:rows], w.dense), rtol=0, atol=0)
        scale = packed[rows].abs().max().item()  # bf16 rounding of values near it: one part in 2^8
        torch.testing.assert_close(linear(x[:rows], w), packed[rows], rtol=0, atol=0.02 * scale)
    torch.testing.assert_close(kernels_for("cuda", invariant=True).linear(x, w), packed[48], rtol=0, atol=0)


@pytest.mark.skipif(not CUDA, reason="GPU only")
def test_cuda_runner_with_copies_computes_what_it_did_without() -> None:
    """A q8 runner with dense copies and one without: a step of one row gives the same bits (the packed kernel
    in both), a step of 24 sequences' rows (cuBLAS over the copies in one) the same logits within bf16."""
    import os

    from specserve.engine.local_runner import LocalRunner
    from specserve.model.batch import Batch

    cfg = small_config()
    runners = []
    for copies in ("1", "0"):
        os.environ["SPECSERVE_DENSE_COPIES"] = copies
        kernel_settings.reload()
        try:
            runners.append(LocalRunner.from_weights(cfg, random_weights(cfg, torch.bfloat16, "cuda", seed=6),
                                                    n_seqs=24, n_ctx=256, weight_format="q8"))
        finally:
            os.environ.pop("SPECSERVE_DENSE_COPIES")
            kernel_settings.reload()
    assert runners[0].weights.layers[0].wqkv.dense is not None and runners[1].weights.layers[0].wqkv.dense is None
    one, many = [], []
    for runner in runners:
        b = Batch()
        b.add_sequence([5, 9, 11], 0, 0, "last")
        one.append(runner.forward(b).float())
        b = Batch()
        for s in range(24):
            b.add_sequence([(7 * s + 3) % cfg.vocab_size], 0, s, "last")
        many.append(runner.forward(b).float())
    torch.testing.assert_close(one[0], one[1], rtol=0, atol=0)
    scale = many[1].abs().max().item()
    torch.testing.assert_close(many[0], many[1], rtol=0, atol=0.05 * scale)
