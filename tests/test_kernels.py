"""Triton kernels against their torch references on fresh random inputs.

Runs on CUDA (the GPU machine), or on the CPU under Triton's interpreter
(TRITON_INTERPRET=1) where Triton is installed; skips cleanly elsewhere. (The attention kernel's loop runs to
a bound read on the device; Triton 3.6's interpreter turns that into a Python int with int() of a
one-element array, which numpy 2 refuses: under the interpreter those tests need numpy < 2 or that line
of triton/runtime/interpreter.py taking the array's single element.)
"""

from __future__ import annotations

import os

import pytest
import torch

from specserve.kernels import settings as kernel_settings
from specserve.kernels.backend import kernels_for
from specserve.kernels.settings import HAVE_TRITON
from specserve.model.kv_cache import PagedKV
from tests.paged import dense_attention, paged_cache, tree_rows

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not HAVE_TRITON or not (torch.cuda.is_available() or INTERPRET):
    pytest.skip("needs Triton and a CUDA device (or TRITON_INTERPRET=1)", allow_module_level=True)

import triton  # noqa: E402  (after the skip: Triton is installed here)
import triton.language as tl  # noqa: E402

from specserve.kernels.attention_triton import _load_rows  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
TOL = 2e-2 if DEVICE == "cuda" else 1e-4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("rows,cols", [(1, 576), (7, 896), (33, 1536), (3, 100)])
def test_add_rms_norm(rows: int, cols: int) -> None:
    from specserve.kernels import rmsnorm_triton
    from specserve.kernels.rmsnorm import add_rms_norm_ref, rms_norm_ref

    x = torch.randn(rows, cols, device=DEVICE).to(DTYPE)
    r = torch.randn(rows, cols, device=DEVICE).to(DTYPE)
    w = torch.randn(cols, device=DEVICE)
    out, summed = rmsnorm_triton.add_rms_norm(x, r, w, 1e-6)
    ref_out, ref_sum = add_rms_norm_ref(x, r, w, 1e-6)
    assert torch.equal(summed, ref_sum)
    assert rel_err(out, ref_out) < TOL
    assert rel_err(rmsnorm_triton.rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5)) < TOL


@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("n_heads,n_kv,head_dim", [(9, 3, 64), (12, 2, 128), (14, 2, 64)])
@pytest.mark.parametrize("head_norms", [False, True])
def test_rope_and_cache(style: str, n_heads: int, n_kv: int, head_dim: int, head_norms: bool) -> None:
    """head_norms: Qwen3's per-head RMSNorms of q and k, folded into the same launch, against rms_norm_ref of
    each head then the reference RoPE."""
    from specserve.kernels import rope_triton
    from specserve.kernels.rmsnorm import rms_norm_ref
    from specserve.kernels.rope import rope_and_cache_ref, rope_cos_sin

    n_tok, n_seqs, ctx = 11, 3, 40
    qkv = torch.randn(n_tok, (n_heads + 2 * n_kv) * head_dim, device=DEVICE).to(DTYPE)
    q = qkv[:, : n_heads * head_dim].view(n_tok, n_heads, head_dim)
    k = qkv[:, n_heads * head_dim : (n_heads + n_kv) * head_dim].view(n_tok, n_kv, head_dim)
    v = qkv[:, (n_heads + n_kv) * head_dim :].view(n_tok, n_kv, head_dim)
    cos, sin = rope_cos_sin(head_dim, 10000.0, ctx, device=DEVICE)
    positions = torch.randperm(ctx, device=DEVICE)[:n_tok]
    slots = torch.randperm(n_seqs * ctx, device=DEVICE)[:n_tok]  # anywhere in the pool
    kv = torch.randn(2, 2, n_seqs * ctx // 8, n_kv, 8, head_dim, device=DEVICE).to(DTYPE)  # blocks of 8 positions
    kv_ref = kv.clone()
    norms = (torch.rand(head_dim, device=DEVICE) + 0.5, torch.rand(head_dim, device=DEVICE) + 0.5, 1e-6)
    got_q = rope_triton.rope_and_cache(q, k, v, cos, sin, positions, slots, kv[1, 0], kv[1, 1], style,
                                       norms if head_norms else None)
    if head_norms:
        q, k = rms_norm_ref(q, norms[0], norms[2]), rms_norm_ref(k, norms[1], norms[2])
    ref_q = rope_and_cache_ref(q, k, v, cos, sin, positions, slots, kv_ref[1, 0], kv_ref[1, 1], style)
    assert rel_err(got_q, ref_q) < TOL
    assert rel_err(kv, kv_ref) < TOL
    assert torch.equal(kv[0], kv_ref[0])  # the other layer untouched


@pytest.mark.parametrize("n_heads,n_kv,head_dim", [(9, 3, 64), (12, 2, 128), (14, 2, 64)])
@pytest.mark.parametrize("rows_per_seq,ctx,block_size", [(1, 600, 16), (4, 600, 16), (9, 600, 128), (3, 5000, 16)])
def test_attention(n_heads: int, n_kv: int, head_dim: int, rows_per_seq: int, ctx: int, block_size: int) -> None:
    """Over a paged cache whose blocks lie scattered in the pool, against the dense layout's attention."""
    from specserve.kernels import attention_triton

    n_seqs = 3  # several splits (5000: longer splits, 40 of them)
    cache = paged_cache(n_seqs, n_kv, ctx, head_dim, torch.Generator().manual_seed(ctx + head_dim), block_size,
                        DTYPE, DEVICE)
    seq_lens = torch.randint(rows_per_seq, ctx, (n_seqs,)).tolist()
    seq_ids, positions, runs = [], [], []
    for seq, length in enumerate(seq_lens):
        start = len(seq_ids)
        for p in range(length - rows_per_seq, length):
            seq_ids.append(seq)
            positions.append(p)
        runs.append((seq, start, len(seq_ids), length))
    q = torch.randn(len(seq_ids), n_heads, head_dim, device=DEVICE).to(DTYPE)
    pos_t = torch.tensor(positions, device=DEVICE)
    seq_t = torch.tensor(seq_ids, device=DEVICE)
    scale = head_dim ** -0.5
    got = attention_triton.attention(q, cache.k, cache.v, pos_t, seq_t, cache.table, scale)
    assert rel_err(got, dense_attention(q, cache, pos_t, seq_t, scale)) < TOL


@pytest.mark.parametrize("n_heads,n_kv,head_dim", [(12, 2, 128), (9, 3, 64)])
@pytest.mark.parametrize("lead", [0, 5])
def test_attention_tiles_prompt_chunks(n_heads: int, n_kv: int, head_dim: int, lead: int) -> None:
    """A step of many rows: decode rows of several sequences, then two prompt chunks (one from position 0, one deep
    into its sequence); `lead` decode rows first put the chunks off the tiles' edges, so some tiles hold two
    sequences (row kernels) and the rest one (the tiled kernel). Every row against the dense reference."""
    from specserve.kernels import attention_triton

    n_seqs, ctx = 6, 700
    cache = paged_cache(n_seqs, n_kv, ctx, head_dim, torch.Generator().manual_seed(lead + head_dim), 16, DTYPE, DEVICE)
    seq_ids = [2 + i % 4 for i in range(lead)] + [0] * 70 + [1] * 40 + [2, 3, 4, 5] * 2
    positions = [600 + i for i in range(lead)] + list(range(70)) + list(range(500, 540)) + [699, 650, 9, 1] * 2
    assert len(seq_ids) >= attention_triton.TILED_MIN_ROWS
    q = torch.randn(len(seq_ids), n_heads, head_dim, device=DEVICE).to(DTYPE)
    pos_t = torch.tensor(positions, device=DEVICE)
    seq_t = torch.tensor(seq_ids, device=DEVICE)
    scale = head_dim ** -0.5
    expected = dense_attention(q, cache, pos_t, seq_t, scale)
    tiled = attention_triton.attention(q, cache.k, cache.v, pos_t, seq_t, cache.table, scale)
    rows = attention_triton.attention(q, cache.k, cache.v, pos_t, seq_t, cache.table, scale, tiled=False)
    assert rel_err(tiled, expected) < TOL and rel_err(rows, expected) < TOL
    for r in range(len(seq_ids)):  # row by row: a row the tiled kernel missed would be garbage, not small error
        assert rel_err(tiled[r], expected[r]) < 4 * TOL, r


def test_attention_tiles_deep_verify_runs() -> None:
    """Four sequences' 16-row runs deep into their contexts (64 rows: every tile one sequence's): the tiled kernel cuts
    each tile's keys into splits, some of which hold keys only some of the tile's rows see."""
    from specserve.kernels import attention_triton

    n_heads, n_kv, head_dim, ctx = 12, 2, 128, 3100
    cache = paged_cache(4, n_kv, ctx, head_dim, torch.Generator().manual_seed(11), 16, DTYPE, DEVICE)
    seq_ids = [s for s in range(4) for _ in range(16)]
    positions = [start + i for start in (3000, 40, 1500, 2990) for i in range(16)]
    q = torch.randn(len(seq_ids), n_heads, head_dim, device=DEVICE).to(DTYPE)
    pos_t, seq_t = torch.tensor(positions, device=DEVICE), torch.tensor(seq_ids, device=DEVICE)
    got = attention_triton.attention(q, cache.k, cache.v, pos_t, seq_t, cache.table, head_dim ** -0.5)
    expected = dense_attention(q, cache, pos_t, seq_t, head_dim ** -0.5)
    assert max(rel_err(got[r], expected[r]) for r in range(len(seq_ids))) < 4 * TOL


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_attention_tiles_read_packed_rows(name: str) -> None:
    """-ctk/-ctv q8_0 or q4_0 pools: the tiled kernel decodes packed rows as the row kernels do (a prompt chunk of 64
    rows against the same rows through the row kernels)."""
    from specserve.kernels import attention_triton
    from specserve.kernels.kv_format import FORMATS

    n_heads, n_kv, head_dim, ctx = 12, 2, 128, 200
    fmt = FORMATS[name]
    cache = paged_cache(1, n_kv, ctx, head_dim, torch.Generator().manual_seed(3), 16, torch.float32, "cpu")
    k, v = (fmt.encode(c.reshape(-1, head_dim)).view(*c.shape[:3], -1).to(DEVICE) for c in (cache.k, cache.v))
    positions = torch.arange(100, 164, device=DEVICE)
    seq_ids = torch.zeros(64, dtype=torch.long, device=DEVICE)
    q = torch.randn(64, n_heads, head_dim, device=DEVICE).to(DTYPE)
    table = cache.table.to(DEVICE)
    tiled = attention_triton.attention(q, k, v, positions, seq_ids, table, head_dim ** -0.5)
    rows = attention_triton.attention(q, k, v, positions, seq_ids, table, head_dim ** -0.5, tiled=False)
    assert rel_err(tiled, rows) < TOL


@pytest.mark.parametrize("start", [5, 3000])
def test_attention_of_token_tree_rows(start: int) -> None:
    """A token tree's rows see the cache before the tree and their own branch only, at any split layout."""
    from specserve.kernels import attention_triton

    n_heads, n_kv, head_dim = 12, 2, 128
    cache = paged_cache(2, n_kv, 3100, head_dim, torch.Generator().manual_seed(start), 16, DTYPE, DEVICE)
    parents = [-1, 0, 1, 2, 1, 0, 5, 6, 0]
    q = torch.randn(len(parents) + 1, n_heads, head_dim, device=DEVICE).to(DTYPE)
    rows = tree_rows(cache, q, start, parents, 2500, head_dim ** -0.5)
    got = attention_triton.attention(q, cache.k, cache.v, rows.positions, rows.seq_ids, cache.table,
                                     head_dim ** -0.5, rows.hidden)
    assert rel_err(got.float().cpu(), rows.expected) < TOL


def test_attention_follows_the_rows_context_not_the_tables_width() -> None:
    """A table as wide as a large pool (its tail pointing anywhere) gives the same bits as a tight one: a row reads
    its own positions only, so its work and result follow its context, not the pool (-c)."""
    from specserve.kernels import attention_triton

    n_heads, n_kv, head_dim, ctx = 12, 2, 128, 300
    cache = paged_cache(2, n_kv, ctx, head_dim, torch.Generator().manual_seed(7), 16, DTYPE, DEVICE)
    wide = torch.randint(0, cache.k.shape[0], (2, 4096), dtype=torch.int32, device=DEVICE)  # 65,536 positions
    wide[:, : cache.table.shape[1]] = cache.table
    positions = torch.tensor([0, 63, 64, 299, 150, 17], device=DEVICE)
    seq_ids = torch.tensor([0, 0, 0, 0, 1, 1], device=DEVICE)
    q = torch.randn(len(positions), n_heads, head_dim, device=DEVICE).to(DTYPE)
    scale = head_dim ** -0.5
    tight = attention_triton.attention(q, cache.k, cache.v, positions, seq_ids, cache.table, scale)
    assert torch.equal(attention_triton.attention(q, cache.k, cache.v, positions, seq_ids, wide, scale), tight)
    assert rel_err(tight, dense_attention(q, cache, positions, seq_ids, scale)) < TOL


@pytest.mark.parametrize("rows,cols", [(1, 8960), (5, 96), (16, 1000)])
def test_silu_mul(rows: int, cols: int) -> None:
    from specserve.kernels import activation_triton
    from specserve.kernels.activation import silu_mul_ref

    x = torch.randn(rows, 2 * cols, device=DEVICE).to(DTYPE)
    assert rel_err(activation_triton.silu_mul(x), silu_mul_ref(x)) < TOL


def test_quantize_q8_round_trip() -> None:
    from specserve.kernels import linear_triton
    from specserve.kernels.quant_weight import dequantize_ref, quantize_q8, unpack

    # values that are exactly Q8_0 (int8 times an fp16 scale per 32) come back exactly
    q = torch.randint(-127, 128, (48, 320), dtype=torch.int8)
    q[:, ::32] = 127  # each block reaches the full range, as Q8_0's rule makes it
    d = (torch.rand(48, 10) * 0.02 + 1e-4).half().float()
    w = (q.float().view(48, 10, 32) * d[..., None]).view(48, 320)
    qw = quantize_q8(w.to(DEVICE))
    assert qw.bits == 8 and torch.equal(unpack(qw.words, 8, 32).cpu() - 128, q.int())
    assert torch.equal(qw.sm[..., 0].float().cpu(), d)
    assert torch.equal(dequantize_ref(qw, torch.float32).cpu(), w)
    assert torch.equal(linear_triton.dequantize(qw, torch.float32).cpu(), w)
    # any weights: error of one rounding step per block
    w = torch.randn(33, 64, device=DEVICE)
    assert rel_err(dequantize_ref(quantize_q8(w), torch.float32), w) < 1e-2


def random_quant(n: int, k: int, group: int, with_min: bool):
    """A QuantWeight shaped like a GGUF K-quant: Q4_K-like 4-bit ints with mins, or Q6_K-like signed
    6-bit ints (8 bits packed), fp32 scales (and mins) per group."""
    from specserve.kernels.quant_weight import QuantWeight

    low, high = (0, 16) if with_min else (-32, 32)
    q = torch.randint(low, high, (n, k), dtype=torch.int8, device=DEVICE)
    scale = torch.rand(n, k // group, device=DEVICE) * 0.02 + 1e-3
    mins = torch.rand(n, k // group, device=DEVICE) * 0.1 if with_min else None
    return QuantWeight.from_ints(q, scale, mins, group)


@pytest.mark.parametrize("group,with_min", [(32, True), (16, False)])
def test_dequantize_groups(group: int, with_min: bool) -> None:
    from specserve.kernels import linear_triton
    from specserve.kernels.quant_weight import dequantize_ref

    qw = random_quant(70, 256, group, with_min)
    # the GPU may fuse q * scale - min into one FMA (one rounding fewer than torch's two)
    torch.testing.assert_close(linear_triton.dequantize(qw, torch.float32), dequantize_ref(qw, torch.float32),
                               rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("rows", [1, 3, 8, 16])
@pytest.mark.parametrize("fmt", ["float", "q8", "k32min", "k16"])
@pytest.mark.parametrize("n_out,k,bias,silu_input,out_fp32", [
    (40, 96, False, False, False), (130, 288, True, False, False), (72, 160, False, True, False),
    (257, 64, False, False, True),
])
def test_gemv(rows: int, fmt: str, n_out: int, k: int, bias: bool, silu_input: bool, out_fp32: bool) -> None:
    from specserve.kernels import linear_triton
    from specserve.kernels.linear import linear_ref
    from specserve.kernels.quant_weight import quantize_q8

    x = torch.randn(rows, 2 * k if silu_input else k, device=DEVICE).to(DTYPE)
    w = (torch.randn(n_out, k, device=DEVICE) * k ** -0.5).to(DTYPE)
    qw = {"float": lambda: w, "q8": lambda: quantize_q8(w), "k32min": lambda: random_quant(n_out, k, 32, True),
          "k16": lambda: random_quant(n_out, k, 16, False)}[fmt]()
    b = torch.randn(n_out, device=DEVICE).to(DTYPE) if bias else None
    out_dtype = torch.float32 if out_fp32 else DTYPE
    got = linear_triton.gemv(x, qw, b, silu_input, out_dtype)
    ref = linear_ref(x.float(), qw if fmt != "float" else w.float(), b.float() if bias else None, silu_input)
    assert got.dtype == out_dtype and got.shape == (rows, n_out)
    assert rel_err(got, ref) < TOL
    if fmt != "float":  # both integer widths of the kernels are covered
        assert qw.bits == {"q8": 8, "k32min": 4, "k16": 8}[fmt]


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA C kernels (NVRTC): GPU only")
@pytest.mark.parametrize("kernel,fmt,blocks", [
    ("gemv_q", "k32min", None), ("gemv_q", "k16", None), ("gemv_q", "q8", None), ("gemv_q", "k4g16", None),
    ("gemv_q", "k32min", {"RN": 3, "U": 2, "KSPLIT": 4}), ("gemv_q", "k16", {"RN": 2, "U": 1, "KSPLIT": 8}),
    ("gemv_mma", "k32min", None), ("gemv_mma", "k16", None), ("gemv_mma", "q8", None),
    ("gemv_mma", "k32min", {"TILES": 2, "KSPLIT": 4, "D": 3}), ("gemv_mma", "k16", {"TILES": 3, "KSPLIT": 1, "D": 1}),
    ("gemv_mma", "q8", {"TILES": 1, "KSPLIT": 16, "D": 2}),
    # K split across the blocks of a cluster (sm_90+; one block per tile elsewhere)
    ("gemv_mma", "k32min", {"TILES": 1, "KSPLIT": 4, "D": 2, "KC": 4}), ("gemv_mma", "k16", {"TILES": 2, "KSPLIT": 1,
                                                                                            "D": 2, "KC": 2}),
])
@pytest.mark.parametrize("n_out,k,bias,silu_input,out_fp32", [
    (40, 128, False, False, False), (130, 1536, True, False, False), (72, 8960, False, True, False),
    (1000, 4096, True, True, True), (32784, 256, False, False, True),  # > 2048 tiles: the output matrix's blocks
])
def test_gemv_cuda(kernel: str, fmt: str, blocks: dict | None, n_out: int, k: int, bias: bool, silu_input: bool,
                   out_fp32: bool) -> None:
    """The CUDA C kernels vs the torch reference for 1..16 rows, and each row of a multi-row call
    bit for bit equal to a one-row call (verify steps compute what decode steps compute)."""
    from specserve.kernels import quant_cuda
    from specserve.kernels.linear import linear_ref
    from specserve.kernels.quant_weight import QuantWeight, quantize_q8

    w = (torch.randn(n_out, k, device=DEVICE) * k ** -0.5).to(DTYPE)
    if fmt == "k4g16":  # 4-bit integers in groups of 16 (two words per group: CUDA cores only)
        q = torch.randint(0, 16, (n_out, k), dtype=torch.int8, device=DEVICE)
        qw = QuantWeight.from_ints(q, torch.rand(n_out, k // 16, device=DEVICE) * 0.02, None, 16)
    else:
        qw = {"q8": lambda: quantize_q8(w), "k32min": lambda: random_quant(n_out, k, 32, True),
              "k16": lambda: random_quant(n_out, k, 16, False)}[fmt]()
    b = torch.randn(n_out, device=DEVICE).to(DTYPE) if bias else None
    out_dtype = torch.float32 if out_fp32 else DTYPE
    x = torch.randn(16, 2 * k if silu_input else k, device=DEVICE).to(DTYPE) * 2
    assert quant_cuda.usable(x, qw, b, out_dtype) == ("gemv_q" if fmt == "k4g16" else "gemv_mma")

    def run(rows: torch.Tensor) -> torch.Tensor:
        return quant_cuda.gemv(rows, qw, b, silu_input, out_dtype, blocks, kernel=kernel)

    singles = [run(x[i:i + 1]) for i in range(16)]
    for rows in (1, 3, 8, 9, 16):
        got = run(x[:rows])
        ref = linear_ref(x[:rows].float(), qw, b.float() if bias else None, silu_input)
        assert got.dtype == out_dtype and got.shape == (rows, n_out)
        assert rel_err(got, ref) < TOL
        assert torch.equal(got, torch.cat(singles[:rows]))


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA C kernels (NVRTC): GPU only")
def test_quantized_verify_rows_compute_what_decode_computes() -> None:
    """Up to MAX_SLICED_ROWS rows (long verify steps) go through the same kernel as one row, in slices."""
    from specserve.kernels.quant_weight import MAX_SLICED_ROWS

    linear = kernels_for(DEVICE).linear

    qw = random_quant(300, 1536, 32, True)
    x = torch.randn(MAX_SLICED_ROWS, 1536, device=DEVICE).to(DTYPE)
    singles = torch.cat([linear(x[i:i + 1], qw) for i in range(MAX_SLICED_ROWS)])
    for rows in (17, 40, MAX_SLICED_ROWS):
        assert torch.equal(linear(x[:rows], qw), singles[:rows])


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA C kernels (NVRTC): GPU only")
@pytest.mark.parametrize("fmt", ["k32min", "k16"])
@pytest.mark.parametrize("n_ff", [256, 264])  # 264: the last tile's 8 gate rows start past a 16-row boundary
def test_swiglu_in_gate_up_output(fmt: str, n_ff: int) -> None:
    """SwiGLU in the tensor-core gate_up kernel's output: silu(gate) * up to bf16 rounding, and for down
    the same activations its input stage computed before, bit for bit (1..16 rows, and sliced above)."""
    from specserve.kernels import quant_cuda
    from specserve.kernels.activation import silu_mul_ref
    from specserve.kernels.step_ops import feed_forward

    kernels = kernels_for(DEVICE)
    linear = kernels.linear

    k = 1536
    w_gate_up = random_quant(2 * n_ff, k, 32 if fmt == "k32min" else 16, fmt == "k32min")
    w_down = random_quant(48, n_ff, 32, True) if n_ff % 32 == 0 else None  # 264: no whole groups of 16 or 32
    x = torch.randn(20, k, device=DEVICE).to(DTYPE)
    for rows in (1, 3, 9, 16, 20):
        act = quant_cuda.gemv(x[:rows], w_gate_up, None, False, DTYPE, kernel="gemv_mma", swiglu_output=True)
        gate_up = quant_cuda.gemv(x[:rows], w_gate_up, None, False, DTYPE, kernel="gemv_mma")
        assert act.shape == (rows, n_ff)
        assert rel_err(act, silu_mul_ref(gate_up.float())) < TOL
        if w_down is not None:
            assert torch.equal(feed_forward(x[:rows], w_gate_up, w_down, kernels),
                               linear(gate_up, w_down, silu_input=True))


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA C kernels (NVRTC): GPU only")
def test_bf16x2_products_round_like_fp32_products() -> None:
    """RMSNorm staging multiplies x by its weight two bf16 values at a time (mul_bf16x2: one fma.rn.bf16x2
    adding -0); that must give the fp32 product rounded to bf16 (torch's bf16 multiply, and what the staging
    did value by value before): bit patterns drawn over the whole range (subnormals, products that overflow
    or underflow), signed zeros; NaN only as NaN."""
    from specserve.kernels.cuda import build

    source = build.common_source() + r"""
extern "C" __global__ void mul_pairs(const unsigned* a, const unsigned* b, unsigned* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = mul_bf16x2(a[i], b[i]);
}"""
    kernel = torch.cuda._compile_kernel(source, "mul_pairs")
    n = 1 << 20
    bits = torch.randint(-(1 << 15), 1 << 15, (2, 2 * n), dtype=torch.int16, device=DEVICE)
    bits[:, :4] = torch.tensor([0, -(1 << 15), 1, -(1 << 15) + 1], dtype=torch.int16)  # +0, -0, subnormals
    a, b = bits.view(torch.bfloat16)
    out = torch.empty(n, dtype=torch.int32, device=DEVICE)
    kernel(grid=(n // 256, 1, 1), block=(256, 1, 1), args=[a.view(torch.int32), b.view(torch.int32), out, n])
    got, ref = out.view(torch.bfloat16), (a.float() * b.float()).to(torch.bfloat16)
    nan = ref.isnan()
    assert torch.equal(got.isnan(), nan) and nan.float().mean() < 0.01
    assert torch.equal(got.view(torch.int16)[~nan], ref.view(torch.int16)[~nan])


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA C kernels (NVRTC): GPU only")
@pytest.mark.parametrize("fmt", ["k32min", "k16"])
def test_norm_and_residual_add_fold_into_the_product(fmt: str) -> None:
    """RMSNorm folded into the tensor-core kernel's input matches rms_norm then the product (to bf16
    rounding of the normed values), and each row of a multi-row call is bit for bit a one-row call;
    the product added to a residual stream in place is exactly the bf16 sum of the two."""
    from specserve.kernels.rmsnorm import rms_norm_ref
    from specserve.kernels.step_ops import linear_fused

    linear = kernels_for(DEVICE).linear

    k, n = 1536, 272
    w = random_quant(n, k, 32 if fmt == "k32min" else 16, fmt == "k32min")
    x = torch.randn(20, k, device=DEVICE).to(DTYPE) * 3
    norm_w = (torch.rand(k, device=DEVICE) + 0.5).to(DTYPE)
    residual = torch.randn(20, n, device=DEVICE).to(DTYPE)
    singles = torch.cat([linear_fused(x[i:i + 1], w, norm=(norm_w, 1e-6)) for i in range(20)])
    for rows in (1, 3, 16, 20):
        got = linear_fused(x[:rows], w, norm=(norm_w, 1e-6))
        ref = linear(rms_norm_ref(x[:rows], norm_w, 1e-6), w)
        assert rel_err(got, ref) < TOL
        assert torch.equal(got, singles[:rows])
        stream = residual[:rows].clone()
        assert linear_fused(x[:rows], w, add_to=stream).data_ptr() == stream.data_ptr()
        assert torch.equal(stream, residual[:rows] + linear(x[:rows], w))
    logits = linear_fused(x[:3], w, norm=(norm_w, 1e-6), out_dtype=torch.float32)
    assert logits.dtype == torch.float32 and torch.equal(logits, singles[:3].float())


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA C kernels (NVRTC): GPU only")
@pytest.mark.parametrize("kc", [2, 3, 4])
def test_residual_add_with_k_split_across_a_cluster(kc: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A product whose K is split across the blocks of a cluster (down's shape; sm_90+, one block a tile
    elsewhere) adds to the residual stream what the reference computes (to fp32 rounding: the shares are
    summed in another order than one block sums them), and each row of a multi-row call bit for bit what a
    one-row call adds."""
    from specserve.kernels import quant_cuda
    from specserve.kernels.cuda import build
    from specserve.kernels.linear import linear_ref

    k, n = 8960, 96
    w = random_quant(n, k, 32, True)
    x = torch.randn(16, k, device=DEVICE).to(DTYPE)
    residual = torch.randn(16, n, device=DEVICE).to(DTYPE)
    blocks = {"TILES": 1, "KSPLIT": 4, "D": 2, "KC": kc}
    built = build.kernel
    launched: set[int] = set()  # the KC of every variant launched

    def spy(key: tuple, sibling: object = None) -> object:
        launched.add(key[-2])  # (the last: EXPERTS)
        return built(key, sibling)

    monkeypatch.setattr(build, "kernel", spy)

    def add(lo: int, hi: int) -> torch.Tensor:
        stream = residual[lo:hi].clone()
        quant_cuda.gemv(x[lo:hi], w, None, False, DTYPE, blocks, kernel="gemv_mma", add_to=stream)
        return stream

    singles = torch.cat([add(i, i + 1) for i in range(16)])
    for rows in (1, 5, 8, 16):
        got = add(0, rows)
        product = linear_ref(x[:rows].float(), w, None, False)
        assert rel_err(got, residual[:rows].float() + product) < TOL
        assert rel_err(got.float() - residual[:rows].float(), product) < TOL
        assert torch.equal(got, singles[:rows])
    assert launched == ({kc} if torch.cuda.get_device_capability()[0] >= 9 else {1})


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA C kernels (NVRTC): GPU only")
@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("n_heads,n_kv,head_dim", [(4, 2, 64), (12, 2, 128)])
def test_rope_and_kv_write_fold_into_the_qkv_product(style: str, n_heads: int, n_kv: int, head_dim: int) -> None:
    """RoPE and the KV-cache write in the QKV product's epilogue vs the product then rope_and_cache;
    each row of a multi-row call bit for bit a one-row call."""
    from specserve.kernels.rope import RopeWrite, rope_cos_sin
    from specserve.kernels.step_ops import linear_fused

    rope_and_cache = kernels_for(DEVICE).rope_and_cache

    k, ctx, n_seqs = 512, 64, 3
    n_out = (n_heads + 2 * n_kv) * head_dim
    w = random_quant(n_out, k, 32, True)
    bias = torch.randn(n_out, device=DEVICE).to(DTYPE)
    norm = ((torch.rand(k, device=DEVICE) + 0.5).to(DTYPE), 1e-6)
    cos, sin = rope_cos_sin(head_dim, 10000.0, ctx, device=DEVICE)
    x = torch.randn(20, k, device=DEVICE).to(DTYPE)
    positions = torch.randperm(ctx, device=DEVICE)[:20]
    slots = torch.randperm(n_seqs * ctx, device=DEVICE)[:20]

    def fused(rows: slice, caches: torch.Tensor) -> torch.Tensor:
        rope = RopeWrite(cos, sin, positions[rows], slots[rows], caches[0], caches[1], n_heads, n_kv, style)
        return linear_fused(x[rows], w, bias, norm=norm, rope=rope)

    singles_kv = torch.zeros(2, n_seqs * ctx // 16, n_kv, 16, head_dim, device=DEVICE, dtype=DTYPE)
    singles = torch.cat([fused(slice(i, i + 1), singles_kv) for i in range(20)])
    for rows in (1, 5, 16, 20):
        caches = torch.zeros_like(singles_kv)
        got = fused(slice(0, rows), caches)
        assert torch.equal(got, singles[:rows])
        qkv = linear_fused(x[:rows], w, bias, norm=norm)
        q, kk, v = qkv.split([n_heads * head_dim, n_kv * head_dim, n_kv * head_dim], dim=-1)
        ref_caches = torch.zeros_like(caches)
        ref_q = rope_and_cache(q.view(rows, n_heads, head_dim), kk.view(rows, n_kv, head_dim),
                               v.reshape(rows, n_kv, head_dim), cos, sin, positions[:rows], slots[:rows],
                               ref_caches[0], ref_caches[1], style)
        assert rel_err(got, ref_q.view(rows, -1)) < TOL
        assert rel_err(caches[0], ref_caches[0]) < TOL
        assert torch.equal(caches[1], ref_caches[1])  # v: copied, not rotated
    assert torch.equal(caches, singles_kv)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA C kernels (NVRTC): GPU only")
def test_dependent_launches_compute_what_plain_launches_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain of products each reading the one before (and a residual stream written in place), with
    programmatic dependent launch (kernels start before their predecessor ends) and without."""
    from specserve.kernels.cuda import build
    from specserve.kernels.step_ops import feed_forward, linear_fused

    monkeypatch.setenv("SPECSERVE_PDL", "1")

    kernel_settings.reload()
    if not build.pdl_enabled(torch.cuda.current_device()):
        pytest.skip("programmatic dependent launch needs sm_90 or newer")
    k = 1536
    w_in, w_out = random_quant(k, k, 32, True), random_quant(k, k, 16, False)
    w_gate_up, w_down = random_quant(1024, k, 32, True), random_quant(k, 512, 32, True)
    norm = ((torch.rand(k, device=DEVICE) + 0.5).to(DTYPE), 1e-6)
    x = torch.randn(4, k, device=DEVICE).to(DTYPE)
    results = {}
    for pdl in ("1", "0"):
        monkeypatch.setenv("SPECSERVE_PDL", pdl)
        kernel_settings.reload()
        residual = x.clone()
        for _ in range(6):
            h = linear_fused(residual, w_in, norm=norm)
            linear_fused(h, w_out, add_to=residual)
            feed_forward(residual, w_gate_up, w_down, kernels_for(DEVICE), norm=norm, add_to=residual)
        results[pdl] = residual
    assert torch.equal(results["1"], results["0"])


@pytest.mark.parametrize("weight_format", ["float", "q8"])
def test_model_forward_kernels_match_reference(weight_format: str) -> None:
    """The whole forward (prefill > 16 rows, decode, verify) with kernels on vs the torch references."""
    import dataclasses

    from specserve.kernels.quant_weight import QuantWeight
    from specserve.kernels.torch_kernels import TorchKernels
    from specserve.model.random_init import SHAPES, random_weights
    from specserve.model.transformer import Transformer
    from specserve.model.weights import quantize_weights

    cfg = dataclasses.replace(SHAPES["qwen2.5-coder-0.5b"], n_layers=2, hidden=128, n_heads=4, n_kv_heads=2,
                              head_dim=64, ffn=96, vocab_size=300)
    weights = quantize_weights(random_weights(cfg, DTYPE, DEVICE, seed=1), weight_format)
    assert isinstance(weights.output, QuantWeight) == (weight_format != "float")
    steps = [list(range(20)), [20], list(range(21, 29))]  # prefill, decode, verify
    outs: dict[str, list[torch.Tensor]] = {}
    for mode, kernels in (("triton", kernels_for(DEVICE)), ("torch", TorchKernels())):
        assert kernels.name == mode
        model = Transformer(cfg, weights, 64, kernels)
        kv = PagedKV(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, n_blocks=4, n_seqs=1, n_ctx=64, block_size=16,
                     dtype=DTYPE, device=torch.device(DEVICE))
        outs[mode] = []
        for pos in steps:
            p = torch.tensor(pos, device=DEVICE)
            tokens = (p * 37 + 5) % cfg.vocab_size
            seq = torch.zeros_like(p)
            runs = [(0, 0, len(pos), pos[-1] + 1)]
            slots = (3 - p // 16) * 16 + p % 16  # the blocks in reverse order
            outs[mode].append(model.forward(tokens, p, seq, None, runs, kv.step(slots)))
    for got, ref in zip(outs["triton"], outs["torch"], strict=True):
        assert got.dtype == torch.float32
        assert rel_err(got, ref) < TOL


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA C kernels (NVRTC): GPU only")
@pytest.mark.parametrize("fold", ["plain", "logits", "norm", "add", "swiglu", "rope", "cluster"])
def test_sixteen_row_slices_in_one_launch_match_their_own_launches(fold: str) -> None:
    """More than 16 rows (a prompt chunk in batch-invariant mode) run as one launch over 16-row slices (block
    rows): every slice, and the remainder, bit for bit what a call of its own rows gives, KV writes included."""
    from specserve.kernels import quant_cuda
    from specserve.kernels.rope import RopeWrite, rope_cos_sin

    k, n_heads, n_kv, head_dim, rows, n_seqs, ctx = 512, 4, 2, 64, 53, 2, 64
    if fold == "cluster":  # down's shape: K split across the blocks of a cluster on sm_90+
        k = 8960
    n_out = (n_heads + 2 * n_kv) * head_dim
    w = random_quant(n_out, k, 32, True)
    x = torch.randn(rows, k, device=DEVICE).to(DTYPE)
    norm = ((torch.rand(k, device=DEVICE) + 0.5).to(DTYPE), 1e-6) if fold == "norm" else None
    residual = torch.randn(rows, n_out, device=DEVICE).to(DTYPE)
    cos, sin = rope_cos_sin(head_dim, 10000.0, ctx, device=DEVICE)
    slots = torch.randperm(n_seqs * ctx, device=DEVICE)[:rows]  # every slot written once
    positions = slots % ctx

    def call(part: slice, caches: torch.Tensor) -> torch.Tensor:
        rope = (RopeWrite(cos, sin, positions[part], slots[part], caches[0], caches[1], n_heads, n_kv, "neox")
                if fold == "rope" else None)
        add_to = residual[part].clone() if fold == "add" else None
        return quant_cuda.gemv(x[part], w, None, False, torch.float32 if fold == "logits" else DTYPE,
                               kernel="gemv_mma", swiglu_output=fold == "swiglu", norm=norm, add_to=add_to,
                               rope=rope)

    caches = torch.zeros(2, n_seqs * ctx // 16, n_kv, 16, head_dim, device=DEVICE, dtype=DTYPE)
    pieces_kv = torch.zeros_like(caches)
    whole = call(slice(0, rows), caches)
    pieces = torch.cat([call(slice(i, min(i + 16, rows)), pieces_kv) for i in range(0, rows, 16)])
    assert torch.equal(whole, pieces)
    assert torch.equal(caches, pieces_kv)
    if fold == "rope":
        assert caches.abs().sum() > 0




@triton.jit
def _load_packed(c_ptr, rows_ptr, out_ptr, n_valid, ROW: tl.constexpr, BITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK: tl.constexpr):
    """BLOCK rows through the attention kernel's row loader, into out [BLOCK, HEAD_DIM]."""
    n = tl.arange(0, BLOCK)
    d = tl.arange(0, HEAD_DIM)
    rows = tl.load(rows_ptr + n).to(tl.int64) * ROW
    x = _load_rows(c_ptr, rows, d, n < n_valid, BITS, HEAD_DIM, BLOCK)
    tl.store(out_ptr + n[:, None] * HEAD_DIM + d[None, :], x)

@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_attention_decodes_packed_rows_exactly(name: str, head_dim: int) -> None:
    """The attention kernel's row loader gives a packed row's decoded values (kv_format's decode) bit for bit,
    each group's scale read once and spread over its 32 values; masked rows load as zeros."""
    from specserve.kernels.kv_format import FORMATS

    fmt = FORMATS[name]
    packed = fmt.encode(torch.randn(40, head_dim) * 3).to(DEVICE)
    picked = torch.randperm(40)[:16].to(torch.int32).to(DEVICE)
    out = torch.full((16, head_dim), float("nan"), device=DEVICE)
    _load_packed[(1,)](packed, picked, out, 13, packed.shape[1], fmt.code_bits, head_dim, 16)
    want = fmt.decode(packed.cpu(), head_dim, torch.float32)[picked.cpu().long()]
    want[13:] = 0
    assert torch.equal(out.cpu(), want)
