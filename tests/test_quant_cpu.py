"""The CPU kernel for packed weights (kernels/quant_cpu.py) against the dequantized reference on fresh
random inputs: every packing layout (4/8-bit, groups of 16/32), row lengths that leave a partial chunk,
1..40 rows, and the model's products through `linear`."""

from __future__ import annotations

import pytest
import torch

from specserve.kernels import quant_cpu
from specserve.kernels.linear import QuantWeight, dequantize_ref, linear

pytestmark = pytest.mark.skipif(not quant_cpu._cpu_has_avx512() or quant_cpu._library() is None,
                                reason="needs AVX-512 and a C compiler (the product dequantizes instead)")


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (4, 16), (8, 32), (8, 16)])
@pytest.mark.parametrize(("n", "k"), [(96, 576), (33, 1536), (7, 160)])
def test_kernel_matches_the_dequantized_product(bits: int, group: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(bits * 1000 + group * 10 + n)
    q = torch.randint(0, 1 << bits, (n, k), generator=gen)
    scale = torch.rand(n, k // group, generator=gen) * 0.05
    mins = torch.randn(n, k // group, generator=gen) * 0.05
    w = QuantWeight.from_ints(q, scale, mins, group)
    ref_w = dequantize_ref(w, torch.float32)
    for rows in (1, 2, 9, 16, 17, 40):
        x = torch.randn(rows, k, generator=gen)
        ours = quant_cpu.gemv(x, w)
        ref = x @ ref_w.t()
        assert torch.isfinite(ours).all()
        assert ((ours - ref).norm() / ref.norm()).item() < 1e-5


def test_linear_takes_the_kernel_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    w = QuantWeight.from_ints(torch.randint(0, 16, (64, 256)), torch.rand(64, 8), torch.rand(64, 8), 32)
    x, bias = torch.randn(3, 256), torch.randn(64)
    calls = []
    real = quant_cpu.gemv
    monkeypatch.setattr(quant_cpu, "gemv", lambda *a: calls.append(1) or real(*a))
    out = linear(x, w, bias)
    ref = x @ dequantize_ref(w, torch.float32).t() + bias
    assert calls and ((out - ref).norm() / ref.norm()).item() < 1e-5
