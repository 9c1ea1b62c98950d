"""Triton kernels against their torch references on fresh random inputs.

Runs on CUDA (the GPU machine), or on the CPU under Triton's interpreter
(TRITON_INTERPRET=1) where Triton is installed; skips cleanly elsewhere.
"""

from __future__ import annotations

import os

import pytest
import torch

from specserve.kernels.dispatch import HAVE_TRITON

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not HAVE_TRITON or not (torch.cuda.is_available() or INTERPRET):
    pytest.skip("needs Triton and a CUDA device (or TRITON_INTERPRET=1)", allow_module_level=True)

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
def test_rope_and_cache(style: str, n_heads: int, n_kv: int, head_dim: int) -> None:
    from specserve.kernels import rope_triton
    from specserve.kernels.rope import rope_and_cache_ref, rope_cos_sin

    n_tok, n_seqs, ctx = 11, 3, 40
    qkv = torch.randn(n_tok, (n_heads + 2 * n_kv) * head_dim, device=DEVICE).to(DTYPE)
    q = qkv[:, : n_heads * head_dim].view(n_tok, n_heads, head_dim)
    k = qkv[:, n_heads * head_dim : (n_heads + n_kv) * head_dim].view(n_tok, n_kv, head_dim)
    v = qkv[:, (n_heads + n_kv) * head_dim :].view(n_tok, n_kv, head_dim)
    cos, sin = rope_cos_sin(head_dim, 10000.0, ctx, device=DEVICE)
    positions = torch.randperm(ctx, device=DEVICE)[:n_tok]
    seq_ids = torch.randint(0, n_seqs, (n_tok,), device=DEVICE)
    kv = torch.randn(2, 2, n_seqs, n_kv, ctx, head_dim, device=DEVICE).to(DTYPE)  # [layer, k/v, ...]
    kv_ref = kv.clone()
    got_q = rope_triton.rope_and_cache(q, k, v, cos, sin, positions, seq_ids, kv[1, 0], kv[1, 1], style)
    ref_q = rope_and_cache_ref(q, k, v, cos, sin, positions, seq_ids, kv_ref[1, 0], kv_ref[1, 1], style)
    assert rel_err(got_q, ref_q) < TOL
    assert rel_err(kv, kv_ref) < TOL
    assert torch.equal(kv[0], kv_ref[0])  # the other layer untouched


@pytest.mark.parametrize("n_heads,n_kv,head_dim", [(9, 3, 64), (12, 2, 128), (14, 2, 64)])
@pytest.mark.parametrize("rows_per_seq", [1, 4, 9])
def test_attention(n_heads: int, n_kv: int, head_dim: int, rows_per_seq: int) -> None:
    from specserve.kernels import attention_triton
    from specserve.kernels.attention import attention_ref

    n_seqs, ctx = 3, 600  # several splits
    k_cache = torch.randn(n_seqs, n_kv, ctx, head_dim, device=DEVICE).to(DTYPE)
    v_cache = torch.randn(n_seqs, n_kv, ctx, head_dim, device=DEVICE).to(DTYPE)
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
    got = attention_triton.attention(q, k_cache, v_cache, pos_t, seq_t, scale)
    ref = attention_ref(q.float(), k_cache.float(), v_cache.float(), pos_t, seq_t, runs, scale)
    assert rel_err(got, ref) < TOL
