"""The CPU kernels for packed weights (kernels/quant_cpu.py) on fresh random inputs: the fp32 kernel against the
dequantized reference, the int8 kernel against a torch reference of its own arithmetic (activations rounded to
int8 per word's k, or per group where its grouped layout runs) and, within a stated tolerance, against the fp32
one; every packing layout (4/8-bit, groups of 16/32), odd N and row lengths of an odd number of groups that
leave a partial chunk (grouped: whole blocks of 16 groups, a partial block of 8 or more, a tail of fewer, a
tail alone), 1..40 rows, and which kernel a CPU runner's `linear` takes."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from specserve.kernels import quant_cpu
from specserve.kernels import settings as kernel_settings
from specserve.kernels.backend import kernels_for
from specserve.kernels.quant_weight import QuantWeight, dequantize_ref, quantize_q8

pytestmark = pytest.mark.skipif(not quant_cpu.kernel_built(), reason="needs a C compiler and AVX2 (+FMA, F16C) or "
                                "AVX-512 VNNI (the product dequantizes instead)")
LAYOUTS = [(4, 32), (4, 16), (8, 32), (8, 16)]
SHAPES = [(96, 576), (33, 1536), (7, 160), (5, 800)]
# The int8 kernel against the exact product on these inputs: relative error ~4e-3 (at most 1.3e-2 seen at one
# row of 160); each activation is off by at most half of its block's max |x| / 127.
INT8_TOLERANCE = 3e-2


def _weight(bits: int, group: int, n: int, k: int, gen: torch.Generator) -> QuantWeight:
    q = torch.randint(0, 1 << bits, (n, k), generator=gen)
    scale = torch.rand(n, k // group, generator=gen) * 0.05
    mins = torch.randn(n, k // group, generator=gen) * 0.05
    return QuantWeight.from_ints(q, scale, mins, group)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize(("bits", "group"), LAYOUTS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_fp32_kernel_matches_the_dequantized_product(bits: int, group: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(bits * 1000 + group * 10 + n)
    w = _weight(bits, group, n, k, gen)
    ref_w = dequantize_ref(w, torch.float32)
    for rows in (1, 2, 9, 16, 17, 40):
        x = torch.randn(rows, k, generator=gen)
        ours = quant_cpu.gemv(x, w, kernel="fp32")
        assert torch.isfinite(ours).all()
        assert _rel(ours, x @ ref_w.t()) < 1e-5


@pytest.mark.parametrize(("bits", "group"), LAYOUTS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_int8_kernel_matches_its_reference_and_the_fp32_kernel(bits: int, group: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(bits * 1001 + group * 11 + n)
    w = _weight(bits, group, n, k, gen)
    for rows in range(1, 18):  # each count up to 16 is its own compiled path; 17 takes two calls
        x = torch.randn(rows, k, generator=gen)
        x[0, : k // 3] *= 20  # an outlier run: its blocks get their own scales
        ours = quant_cpu.gemv(x, w, kernel="int8")
        assert torch.isfinite(ours).all()
        assert _rel(ours, quant_cpu.gemv_int8_ref(x, w)) < 1e-5  # same arithmetic, fp32 vs fp64 sums
        assert _rel(ours, quant_cpu.gemv(x, w, kernel="fp32")) < INT8_TOLERANCE


def test_int8_rounding_reference() -> None:
    """Each block (a word's k) is rounded with its own scale; a zero block stays zero (no 0 / 0)."""
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 4] = 2.54, -1.0  # group 32, 4 bits: k 0, 4, ..., 28 form word 0's block
    q, dx = quant_cpu.quantize_activations_ref(x, 4, 32)
    assert dx[0, 0].item() == pytest.approx(0.02) and dx[0, 1:].eq(0).all()
    assert q[0, 0, :2].tolist() == [127.0, -50.0] and q[0, 1:].eq(0).all()
    q, dx = quant_cpu.quantize_activations_ref(x, 4, 32, per_group=True)  # one scale for the group's 4 words
    assert dx[0].tolist() == pytest.approx([0.02] * 4)
    assert q[0, 0, :2].tolist() == [127.0, -50.0] and q[0, 1:].eq(0).all()


def test_linear_takes_int8_by_default_exact_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    w = QuantWeight.from_ints(torch.randint(0, 16, (64, 256)), torch.rand(64, 8), torch.rand(64, 8), 32)
    bias = torch.randn(64)
    kernels: list[str] = []
    real = quant_cpu.gemv
    monkeypatch.setattr(quant_cpu, "gemv", lambda *a: kernels.append(quant_cpu.kernel_for(a[1])) or real(*a))
    monkeypatch.delenv("SPECSERVE_CPU_EXACT", raising=False)
    default = "int8" if quant_cpu.int8_built() else "fp32"
    for rows in (3, 100):  # the int8 kernel takes prompt chunks too: every row rounded alike
        x = torch.randn(rows, 256)
        ref = x @ dequantize_ref(w, torch.float32).t() + bias
        assert _rel(kernels_for("cpu").linear(x, w, bias), ref) < INT8_TOLERANCE
    assert kernels == [default] * (2 if default == "int8" else 1)
    kernels.clear()
    monkeypatch.setenv("SPECSERVE_CPU_EXACT", "1")
    kernel_settings.reload()
    for rows in (3, 100):  # exact: the kernel up to 64 rows, above that torch's GEMM on the dequantized matrix
        x = torch.randn(rows, 256)
        assert _rel(kernels_for("cpu").linear(x, w, bias), x @ dequantize_ref(w, torch.float32).t() + bias) < 1e-5
    assert kernels == ["fp32"]


def test_a_forked_child_runs_the_kernels() -> None:
    """The pool's workers do not survive a fork: the child must start its own, not wait on the parent's."""
    w = QuantWeight.from_ints(torch.randint(0, 16, (512, 256)), torch.rand(512, 8), torch.rand(512, 8), 32)
    x = torch.randn(2, 256)
    ref = quant_cpu.gemv(x, w)  # the parent's workers exist from here
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 when its product is right
        ok = torch.equal(quant_cpu.gemv(x, w), ref)
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0


def test_products_from_several_threads_at_once() -> None:
    """ctypes lets go of the GIL: products from two Python threads share one pool (one job at a time)."""
    gen = torch.Generator().manual_seed(7)
    weights = [_weight(bits, 32, 300, 192, gen) for bits in (4, 8)]
    xs = [torch.randn(3, 192, generator=gen) for _ in weights]
    refs = [quant_cpu.gemv(x, w) for x, w in zip(xs, weights, strict=True)]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda i: all(torch.equal(quant_cpu.gemv(xs[i % 2], weights[i % 2]), refs[i % 2])
                                              for _ in range(50)), range(4)))
    assert all(results)


def test_call_plans_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights loaded again and again (new addresses) never grow the plan cache past MAX_PLANS; a cleared
    cache rebuilds plans that give the same products."""
    if not quant_cpu.int8_built():
        pytest.skip("no CPU kernel library here")
    monkeypatch.setattr(quant_cpu, "MAX_PLANS", 3)
    monkeypatch.setattr(quant_cpu, "_plans", {})
    x = torch.randn(1, 64)
    first, kept = None, []
    for _ in range(5):
        w = quantize_q8(torch.arange(32 * 64, dtype=torch.float32).reshape(32, 64).sin())
        kept.append(w)  # alive: a new address each time
        y = quant_cpu.gemv(x, w)
        first = y if first is None else first
        assert torch.equal(y, first) and len(quant_cpu._plans) <= 3
