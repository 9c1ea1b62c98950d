"""The CPU decode-step ops in C (kernels/cpu_ops.py) against their torch references on fresh random inputs:
RMSNorm with and without the residual add, RoPE with the KV-cache write (both layouts, partial rotation, views of
one [q | k | v] product), attention of mixed rows of two sequences over paged caches (blocks scattered over the
pool; checked against the dense layout too; grouped heads, a head size with a partial vector), SwiGLU, argmax; that a
row's result does not depend on its batch; and that a CPU runner's kernels (kernels/cpu_kernels.py) run them
for fp32 tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specserve.kernels import activation, attention, cpu_ops, rmsnorm, rope
from specserve.kernels.backend import kernels_for
from specserve.kernels.cpu import build
from specserve.kernels.kv_format import FORMATS
from tests.paged import dense_attention, paged_cache, tree_rows

pytestmark = pytest.mark.skipif(not build.has("cpu_rms_norm"),
                                reason="needs a C compiler and AVX2 (+FMA, F16C) or AVX-512 VNNI")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize(("rows", "dim"), [(1, 576), (5, 100), (64, 896)])
def test_rms_norm(rows: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(rows + dim)
    x, res, w = torch.randn(rows, dim, generator=gen), torch.randn(rows, dim, generator=gen), torch.rand(dim) + 0.5
    assert _rel(cpu_ops.rms_norm(x, w, 1e-5), rmsnorm.rms_norm_ref(x, w, 1e-5)) < 1e-6
    out, summed = cpu_ops.add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_sum = rmsnorm.add_rms_norm_ref(x, res, w, 1e-6)
    assert torch.equal(summed, ref_sum) and _rel(out, ref_out) < 1e-6


@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize(("dim", "rope_dim"), [(64, 64), (80, 48)])
@pytest.mark.parametrize("tokens", [5, 1])  # one row: torch's views of it may carry any row stride
def test_rope_and_cache(style: str, dim: int, rope_dim: int, tokens: int) -> None:
    gen = torch.Generator().manual_seed(dim + rope_dim + len(style))
    n_heads, n_kv, ctx = 6, 2, 40
    qkv = torch.randn(tokens, (n_heads + 2 * n_kv) * dim, generator=gen)  # views of one product, as the model's
    q = qkv[:, : n_heads * dim].view(tokens, n_heads, dim)
    k = qkv[:, n_heads * dim : (n_heads + n_kv) * dim].view(tokens, n_kv, dim)
    v = qkv[:, (n_heads + n_kv) * dim :].view(tokens, n_kv, dim)
    cos, sin = rope.rope_cos_sin(rope_dim, 10000.0, ctx)
    positions = torch.tensor([3, 4, 5, 0, 17])[-tokens:]
    slots = torch.tensor([50, 51, 52, 7, 113])[-tokens:]
    caches = [torch.randn(3 * ctx // 8, n_kv, 8, dim, generator=gen) for _ in range(2)]  # blocks of 8 positions
    ref_caches = [c.clone() for c in caches]
    assert cpu_ops.rope_takes(q, k, v, positions, slots, *caches)
    ours = cpu_ops.rope_and_cache(q, k, v, cos, sin, positions, slots, *caches, style)
    ref = rope.rope_and_cache_ref(q, k, v, cos, sin, positions, slots, *ref_caches, style)
    assert torch.equal(ours, ref)  # elementwise, rounded as torch rounds
    assert all(torch.equal(a, b) for a, b in zip(caches, ref_caches, strict=True))


@pytest.mark.parametrize(("dim", "n_heads", "n_kv"), [(64, 9, 3), (40, 4, 4)])
def test_attention(dim: int, n_heads: int, n_kv: int) -> None:
    gen = torch.Generator().manual_seed(dim + n_heads)
    cache = paged_cache(2, n_kv, 300, dim, gen)
    # a verify run of 4 rows of sequence 0, then one decode row of sequence 1 deep in its cache
    positions = torch.tensor([10, 11, 12, 13, 250])
    seq_ids = torch.tensor([0, 0, 0, 0, 1])
    runs = [(0, 0, 4, 14), (1, 4, 5, 251)]
    q = torch.randn(5, n_heads, dim, generator=gen)
    assert cpu_ops.attention_takes(q, cache.k, cache.v, positions, seq_ids, cache.table)
    ours = cpu_ops.attention(q, cache.k, cache.v, positions, seq_ids, cache.table, dim**-0.5)
    ref = attention.attention_ref(q, cache.k, cache.v, positions, cache.table, runs, dim**-0.5)
    assert _rel(ours, ref) < 1e-5
    assert _rel(ref, dense_attention(q, cache, positions, seq_ids, dim**-0.5)) < 1e-5


@pytest.mark.parametrize("start", [5, 200])
def test_attention_of_token_tree_rows(start: int) -> None:
    """A token tree's rows see the cache before the tree and their own branch only (C, and the torch reference)."""
    gen = torch.Generator().manual_seed(start)
    dim, n_heads, n_kv = 64, 9, 3
    cache = paged_cache(2, n_kv, 300, dim, gen)
    parents = [-1, 0, 1, 2, 1, 0, 5, 6, 0]
    q = torch.randn(len(parents) + 1, n_heads, dim, generator=gen)
    rows = tree_rows(cache, q, start, parents, 250, dim**-0.5)
    ours = cpu_ops.attention(q, cache.k, cache.v, rows.positions, rows.seq_ids, cache.table, dim**-0.5, rows.hidden)
    ref = attention.attention_ref(q, cache.k, cache.v, rows.positions, cache.table, rows.runs, dim**-0.5, rows.hidden)
    assert _rel(ours, rows.expected) < 1e-5
    assert _rel(ref, rows.expected) < 1e-5


@pytest.mark.parametrize(("rows", "n"), [(1, 1536), (3, 100)])
def test_silu_mul(rows: int, n: int) -> None:
    gate_up = torch.randn(rows, 2 * n, generator=torch.Generator().manual_seed(n)) * 6  # reach both tails
    assert _rel(cpu_ops.silu_mul(gate_up), activation.silu_mul_ref(gate_up)) < 1e-6


@pytest.mark.parametrize(("rows", "n"), [(1, 49152), (4, 151936), (3, 37), (2, 5)])
def test_argmax(rows: int, n: int) -> None:
    gen = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, n, generator=gen)
    assert torch.equal(cpu_ops.argmax(x), x.argmax(dim=-1))
    # ties go to the first index; a NaN wins wherever it is; a row of -inf gives 0; as torch's argmax
    x[0, n // 3] = x[0, n - 1] = x[0].max() + 1
    if rows > 1:
        x[1, n - 1] = float("nan")
        x[1, 0] = float("inf")
    if rows > 2:
        x[2] = float("-inf")
    assert torch.equal(cpu_ops.argmax(x), x.argmax(dim=-1))
    assert torch.equal(kernels_for("cpu").argmax(x[:, : n // 2 + 1]), x[:, : n // 2 + 1].argmax(dim=-1))  # a view


def test_cpu_kernels_take_fp32_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = cpu_ops.rms_norm
    monkeypatch.setattr(cpu_ops, "rms_norm", lambda *a: calls.append("c") or real(*a))
    w = torch.rand(64)
    kernels = kernels_for("cpu")
    assert kernels.name == "cpu"
    kernels.rms_norm(torch.randn(3, 64), w, 1e-5)
    kernels.rms_norm(torch.randn(512, 64), w, 1e-5)  # prompt rows too: the same instructions for every row
    assert calls == ["c", "c"]
    kernels.rms_norm(torch.randn(2, 64, dtype=torch.float64), w.double(), 1e-5)  # not fp32: torch
    assert calls == ["c", "c"]


@pytest.mark.parametrize("kv", ["f32", "q8_0"])
def test_a_row_is_the_same_in_any_batch(kv: str) -> None:
    """Each op computes a row on its own: rows of a batch equal the same rows computed alone, bit for bit (attention
    reads a sequence's consecutive rows in runs that share each key block: 20 rows of one sequence across blocks of
    16 positions, then a row of another)."""
    gen = torch.Generator().manual_seed(3)
    n_heads, n_kv, dim, ctx = 6, 2, 64, 64
    c = paged_cache(2, n_kv, ctx, dim, gen)
    k, v = c.k, c.v
    if kv != "f32":
        fmt = FORMATS[kv]
        k, v = (fmt.encode(x.reshape(-1, dim)).view(*x.shape[:3], -1) for x in (c.k, c.v))
    positions = torch.tensor([*range(5, 25), 40])
    seq_ids = torch.tensor([0] * 20 + [1])
    q = torch.randn(len(positions), n_heads, dim, generator=gen)
    batch = cpu_ops.attention(q, k, v, positions, seq_ids, c.table, 0.125)
    for t in range(len(positions)):
        alone = cpu_ops.attention(q[t : t + 1], k, v, positions[t : t + 1], seq_ids[t : t + 1], c.table, 0.125)
        assert torch.equal(alone[0], batch[t])
    assert _rel(batch, dense_attention(q, c, positions, seq_ids, 0.125)) < (1e-5 if kv == "f32" else 2e-2)
    x, res, w = torch.randn(9, 576, generator=gen), torch.randn(9, 576, generator=gen), torch.rand(576) + 0.5
    out, summed = cpu_ops.add_rms_norm(x, res, w, 1e-5)
    gate_up = torch.randn(9, 3072, generator=gen)
    act = cpu_ops.silu_mul(gate_up)
    for t in range(9):
        one, one_sum = cpu_ops.add_rms_norm(x[t : t + 1], res[t : t + 1], w, 1e-5)
        assert torch.equal(one[0], out[t]) and torch.equal(one_sum[0], summed[t])
        assert torch.equal(cpu_ops.silu_mul(gate_up[t : t + 1])[0], act[t])


@pytest.mark.parametrize("target", [name for name, _, _ in build.BUILDS])
def test_every_target_builds(target: str, tmp_path: Path) -> None:
    """Each instruction set's build compiles here, whichever one this CPU runs: an edit to the AVX-512 paths fails
    on an AVX2 machine too, not first on the machines that run them."""
    flags = next(flags for name, _, flags in build.BUILDS if name == target)
    assert build.compile_into(tmp_path / "lib.so", build.SOURCES, [*build.COMMON_FLAGS, *flags]) is None
    assert (tmp_path / "lib.so").stat().st_size > 0
