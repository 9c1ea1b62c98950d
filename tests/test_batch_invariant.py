"""Batch-invariant mode (kernels/batch_invariant.py): a row's bits do not depend on the rest of its step."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from specserve.kernels import batch_invariant
from specserve.kernels.backend import kernels_for
from specserve.kernels.quant_weight import quantize_q8

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the mode changes CUDA kernels only")


@pytest.fixture
def invariant() -> Iterator[None]:
    was = batch_invariant.enabled()
    batch_invariant.enable(True)
    yield
    batch_invariant.enable(was)


@pytest.mark.parametrize("rows", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fixed_slices_compute_the_product(rows: int, with_bias: bool) -> None:
    """The sliced, padded product is x @ w^T + bias (here on the CPU, where it is only checked for values)."""
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 96, generator=g), torch.randn(40, 96, generator=g)
    bias = torch.randn(40, generator=g) if with_bias else None
    y = batch_invariant.linear_float(x.view(1, rows, 96), w, bias)
    assert y.shape == (1, rows, 40)
    torch.testing.assert_close(y[0], F.linear(x, w, bias), rtol=1e-5, atol=1e-4)


def _rows_alone_and_among_others(product, x: torch.Tensor) -> None:
    """product(rows of x) gives each row the bits it gets in any other selection and order of rows."""
    full = product(x)
    n = x.shape[0]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(n)).to(x.device)
    torch.testing.assert_close(product(x[perm]), full[perm], rtol=0, atol=0)
    for m in (1, 2, 7, 16, 17, 64, 65, n - 1):
        torch.testing.assert_close(product(x[n - m:]), full[n - m:], rtol=0, atol=0, msg=f"{m} rows")


@cuda
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("shape", [(1536, 1536), (512, 8960)])
def test_cuda_products_do_not_depend_on_the_batch(invariant: None, packed: bool, shape: tuple[int, int]) -> None:
    n, k = shape
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).bfloat16()
    weight = quantize_q8(w) if packed else w
    bias = None if packed else torch.randn(n, generator=g, device="cuda").bfloat16()
    x = torch.randn(300, k, generator=g, device="cuda").bfloat16()
    kernels = kernels_for("cuda")
    assert kernels.invariant
    _rows_alone_and_among_others(lambda rows: kernels.linear(rows, weight, bias), x)


@cuda
@pytest.mark.parametrize("weight_format", ["float", "gguf"])
def test_a_sequence_gets_its_bits_whatever_shares_its_steps(invariant: None, weight_format: str) -> None:
    """A prompt read alone in one chunk, then decoded alone, gives the logits and KV entries it gets when its
    prompt is cut into other chunks and every step also carries another sequence's prompt and decode rows."""
    from specserve.engine.local_runner import LocalRunner
    from specserve.model.batch import Batch
    from specserve.model.random_init import SHAPES, random_weights

    cfg = dataclasses.replace(SHAPES["qwen2.5-coder-0.5b"], n_layers=2, hidden=256, n_heads=4, n_kv_heads=2,
                              head_dim=64, ffn=512, vocab_size=300)
    runner = LocalRunner.from_weights(cfg, random_weights(cfg, torch.bfloat16, torch.device("cuda"), seed=3),
                                      n_seqs=2, n_ctx=1024, weight_format=weight_format, cuda_graphs=True)
    prompt = [(17 * i + 3) % cfg.vocab_size for i in range(150)]
    other = [(5 * i + 1) % cfg.vocab_size for i in range(90)]
    decoded = [7, 8, 9]

    def alone() -> list[torch.Tensor]:
        runner.kv_truncate(0, 0)
        b = Batch()
        b.add_sequence(prompt, 0, 0, "last")
        out = [runner.forward(b).clone()]
        for i, token in enumerate(decoded):
            b = Batch()
            b.add(token, len(prompt) + i, 0, logits=True)
            out.append(runner.forward(b).clone())
        return out

    def shared() -> list[torch.Tensor]:
        for seq in (0, 1):
            runner.kv_truncate(seq, 0)
        out = []
        pieces = [(0, 37), (37, 101), (101, len(prompt))]
        for j, (start, end) in enumerate(pieces):  # each chunk beside a piece of the other prompt
            b = Batch()
            b.add_sequence(other[30 * j:30 * (j + 1)], 30 * j, 1, "last")
            b.add_sequence(prompt[start:end], start, 0, "last" if end == len(prompt) else "none")
            logits = runner.forward(b)
        out.append(logits[1:2].clone())
        for i, token in enumerate(decoded):  # decode rows beside the other sequence's three-row verify
            b = Batch()
            b.add_sequence([1, 2, 3], len(other) + 3 * i, 1, "all")
            b.add(token, len(prompt) + i, 0, logits=True)
            out.append(runner.forward(b)[3:4].clone())
        return out

    reference = alone()
    kv_alone = runner.kv_read(0)
    for got, want in zip(shared(), reference, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(runner.kv_read(0), kv_alone, rtol=0, atol=0)
