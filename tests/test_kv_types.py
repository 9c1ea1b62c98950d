"""KV cache types (-ctk / -ctv, kernels/kv_format.py): the packed formats against gguf's own quantizers, attention
over packed rows against attention over the rows they decode to (torch reference, and the Triton kernel on CUDA),
the runner's pool size and its slot rows, and a real `specserve serve -ctk q8_0 -ctv q8_0`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gguf
import gguf.quants
import numpy as np
import pytest
import torch

from specserve.engine.local_runner import LocalRunner
from specserve.errors import SpecserveError
from specserve.kernels import cpu_ops
from specserve.kernels.attention import attention_ref
from specserve.kernels.backend import kernels_for
from specserve.kernels.kv_format import FORMATS, format_of, kv_formats
from specserve.kernels.rope import rope_and_cache_ref, rope_cos_sin
from tests.helpers import prefill
from tests.paged import dense_attention, paged_cache
from tests.server_utils import ServerProcess, served
from tests.test_cli_errors import assert_clean_error, run_cli

GGML = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_packed_rows_match_gguf_and_encode_back(name: str) -> None:
    """Within one quantization step of gguf's quantize/dequantize (codes here are taken against the fp16-rounded
    scale, gguf's against the fp32 one), and a decoded row encodes to the same bytes."""
    fmt = FORMATS[name]
    x = torch.randn(40, 3, 128, generator=torch.Generator().manual_seed(1)) * 4
    x[0, 0, :32] = 0  # an all-zero group
    rows = fmt.encode(x)
    assert rows.dtype == torch.uint8 and rows.shape[-1] == fmt.row_width(128)
    got = fmt.decode(rows, 128)
    ref = gguf.quants.dequantize(gguf.quants.quantize(x.reshape(-1, 128).numpy(), GGML[name]), GGML[name])
    step = np.abs(x.numpy()).reshape(-1, 4, 32).max(-1, keepdims=True) / (127 if name == "q8_0" else 8)
    assert (np.abs(got.reshape(-1, 4, 32).numpy() - ref.reshape(-1, 4, 32)) <= step * 1.01 + 1e-6).all()
    assert (got.reshape(-1, 4, 32).abs() <= torch.from_numpy(step) * 128.1).all()
    assert torch.equal(got[0, 0, :32], torch.zeros(32))
    assert torch.equal(fmt.encode(got), rows)
    assert format_of(rows, 128) is fmt


def test_unknown_types_and_head_sizes_are_one_line_errors() -> None:
    with pytest.raises(SpecserveError, match="unknown KV cache type 'q5_1'"):
        kv_formats(("q5_1", None), 64)
    with pytest.raises(SpecserveError, match="multiple of 32"):
        kv_formats((None, "q4_0"), 80)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k_name,v_name", [("q8_0", "q8_0"), ("q4_0", "q8_0"), ("q8_0", "f16"), ("f16", "f16"),
                                           ("bf16", "f16")])
def test_attention_over_packed_rows(device: str, k_name: str, v_name: str) -> None:
    """Attention with K and V stored packed equals attention over the values those rows decode to (the dense
    reference, fp32), on the torch path and the kernel (C on the CPU, Triton on CUDA); rows written by
    rope_and_cache are the format's encoding, the kernel's bytes the reference's."""
    gen = torch.Generator().manual_seed(7)
    n_heads, n_kv, dim, ctx = 8, 2, 64, 300
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cache = paged_cache(3, n_kv, ctx, dim, gen, dtype=torch.float32)
    k_fmt, v_fmt = FORMATS[k_name], FORMATS[v_name]
    k_rows, v_rows = (f.encode(c).to(device) for f, c in ((k_fmt, cache.k), (v_fmt, cache.v)))
    # the dense reference holds what the rows decode to
    blocks = cache.table.long()
    for dense, fmt, rows in ((cache.dense_k, k_fmt, k_rows), (cache.dense_v, v_fmt, v_rows)):
        decoded = fmt.decode(rows.cpu(), dim)[blocks]  # [seqs, blocks, heads, size, dim]
        dense.copy_(decoded.permute(0, 2, 1, 3, 4).flatten(2, 3))
    cache.dense_k, cache.dense_v = cache.dense_k.to(device), cache.dense_v.to(device)
    lens = [ctx, 17, 160]
    seq_ids = [s for s, n in enumerate(lens) for _ in range(2)]
    positions = [p for n in lens for p in (n - 2, n - 1)]
    runs = [(s, 2 * s, 2 * s + 2, n) for s, n in enumerate(lens)]
    q = torch.randn(len(seq_ids), n_heads, dim, generator=gen).to(device, dtype)
    pos_t, seq_t = torch.tensor(positions, device=device), torch.tensor(seq_ids, device=device)
    table = cache.table.to(device)
    want = dense_attention(q, cache, pos_t, seq_t, dim ** -0.5)
    got_ref = attention_ref(q, k_rows, v_rows, pos_t, table, runs, dim ** -0.5)
    kernels = kernels_for(device)
    got = kernels.attention(q, k_rows, v_rows, pos_t, seq_t, table, runs, dim ** -0.5)
    if device == "cpu":  # the C kernel takes every type but bf16 (which keeps the reference)
        assert cpu_ops.attention_takes(q, k_rows, v_rows, pos_t, seq_t, table) == ("bf16" not in (k_name, v_name))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for out in (got_ref, got):
        assert (out.float() - want).abs().max().item() < tol * want.abs().max().item()

    # new rows as one [q | k | v] product's columns (the C kernel's layout)
    qkv = torch.randn(4, (n_heads + 2 * n_kv) * dim, generator=gen).to(device, dtype)
    q_new, k_new, v_new = (part.unflatten(1, (-1, dim)) for part in qkv.split([n_heads * dim, n_kv * dim,
                                                                                 n_kv * dim], dim=1))
    cos, sin = rope_cos_sin(dim, 10000.0, ctx, device=device)
    slots = torch.tensor([5, 40, 41, 200], device=device)
    new_pos = torch.tensor([3, 9, 10, 250], device=device)
    plain_k = torch.zeros(cache.k.shape, dtype=dtype, device=device)
    plain_v = torch.zeros_like(plain_k)
    rope_and_cache_ref(q_new, k_new, v_new, cos, sin, new_pos, slots, plain_k, plain_v, "neox")
    k_ref, v_ref = k_rows.clone(), v_rows.clone()
    rope_and_cache_ref(q_new, k_new, v_new, cos, sin, new_pos, slots, k_ref, v_ref, "neox")
    kernels.rope_and_cache(q_new, k_new, v_new, cos, sin, new_pos, slots, k_rows, v_rows, "neox")  # C on the CPU
    b, o = slots // 16, slots % 16
    for fmt, rows, ref, plain in ((k_fmt, k_rows, k_ref, plain_k), (v_fmt, v_rows, v_ref, plain_v)):
        assert torch.equal(ref[b, :, o], fmt.encode(plain[b, :, o]).to(rows.dtype))
        if device == "cpu":  # the C kernel rotates in fp32 as the reference does: the same bytes
            assert torch.equal(rows, ref)
        else:  # the Triton RoPE rounds its bf16 output apart from torch's: within a code step of the reference
            got, want = (fmt.decode(r[b, :, o].cpu(), dim) for r in (rows, ref))
            step = want.abs().amax(-1, keepdim=True) / (8 if fmt.code_bits == 4 else 127 if fmt.packed else 64)
            assert ((got - want).abs() <= step * 1.01 + 1e-3).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_triton_packing_is_the_formats_encoding(name: str) -> None:
    from specserve.kernels.kv_pack_triton import pack_rows

    fmt = FORMATS[name]
    rows = (torch.randn(7, 2, 128, generator=torch.Generator().manual_seed(5)) * 3).to("cuda", torch.bfloat16)
    rows[0, 0, :32] = 0
    cache = torch.zeros((4, 2, 16, fmt.row_width(128)), dtype=torch.uint8, device="cuda")
    slots = torch.tensor([0, 5, 16, 17, 40, 63, 33], device="cuda")
    pack_rows(rows, slots, cache)
    assert torch.equal(cache[slots // 16, :, slots % 16], fmt.encode(rows))


@pytest.fixture(scope="module")
def runners(smollm_path: Path) -> dict[str, LocalRunner]:
    kw = dict(n_seqs=2, n_ctx=256, device="cpu", progress=False, weight_format="float")
    return {name: LocalRunner(smollm_path, kv_types=(name, name), **kw) for name in ("f32", "f16", "q8_0", "q4_0")}


def test_pool_bytes_and_logits(runners: dict[str, LocalRunner]) -> None:
    """q8_0 rows take 34/64 of f16's bytes and q4_0 18/64; the last logits of a prompt stay near fp32's, closer
    the more bits (measured on smollm2: f16 ~0.006, q8_0 ~0.2, q4_0 ~4 at most over the vocabulary)."""
    sizes = {name: r.memory_info()["kv_bytes"] for name, r in runners.items()}
    assert sizes["f16"] * 2 == sizes["f32"]
    assert sizes["q8_0"] * 64 == sizes["f16"] * 34 and sizes["q4_0"] * 64 == sizes["f16"] * 18
    prompt = list(range(300, 420))
    logits = {name: prefill(r, 0, prompt).float() for name, r in runners.items()}
    err = {name: (logits[name] - logits["f32"]).abs().max().item() for name in ("f16", "q8_0", "q4_0")}
    assert err["f16"] < 0.05 and err["q8_0"] < 1.0 and err["q4_0"] < 10
    assert err["f16"] < err["q8_0"] < err["q4_0"]
    assert int(logits["q8_0"].argmax()) == int(logits["f32"].argmax())


def test_slot_rows_round_trip_packed(runners: dict[str, LocalRunner]) -> None:
    """kv_read decodes a packed sequence, kv_write encodes it into another: the same bytes, the same logits."""
    runner = runners["q4_0"]
    prompt = list(range(500, 560))
    runner.kv_truncate(0, 0)
    runner.kv_truncate(1, 0)
    prefill(runner, 0, prompt[:-1])
    rows = runner.kv_read(0)
    assert rows.dtype == torch.float32 and rows.shape[3] == len(prompt) - 1
    runner.kv_write(1, rows)
    assert torch.equal(runner.kv_read(1), rows)
    a, b = (prefill(runner, seq, prompt, start=len(prompt) - 1) for seq in (0, 1))
    assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("weight_format", ["float", "gguf"])
def test_packed_cache_in_cuda_graphs(smollm_path: Path, weight_format: str) -> None:
    """On CUDA (Triton attention reading q8_0 keys and q4_0 values, the cache written outside the QKV epilogue),
    graphed steps give the eager steps' logits along a greedy continuation."""
    kw = dict(n_seqs=2, n_ctx=256, device="cuda", progress=False, weight_format=weight_format,
              kv_types=("q8_0", "q4_0"))
    graphed, eager = LocalRunner(smollm_path, **kw), LocalRunner(smollm_path, cuda_graphs=False, **kw)
    graphed.warmup(max_rows=4, prompt_rows=32, sequences=2)
    assert graphed.graphs is not None
    prompt = list(range(300, 340))
    a, b = prefill(graphed, 0, prompt), prefill(eager, 0, prompt)
    for _ in range(6):
        assert torch.allclose(a.float(), b.float(), atol=2e-2, rtol=0)
        token = int(a.argmax())
        a, b = (prefill(r, 0, [*prompt, token], start=len(prompt)) for r in (graphed, eager))
        prompt.append(token)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    yield from served("-m", "smollm2-135m", "--device", "cpu", "--weight-format", "float", "-np", "2", "-c", "1024",
                      "-ctk", "q8_0", "-ctv", "q8_0")


def test_served_with_q8_0_cache(server: ServerProcess, smollm_path: Path) -> None:
    """The server's pool is q8_0 (its log says so), and its greedy tokens are an in-process q8_0 runner's."""
    log = server.log_path.read_text()
    assert "K q8_0, V q8_0" in log
    prompt = [1, 504, 2014, 314, 253, 1127, 28, 29, 30, 1380, 314]
    got = server.complete(prompt, 12, return_tokens=True)["tokens"]
    runner = LocalRunner(smollm_path, n_seqs=1, n_ctx=256, device="cpu", progress=False, weight_format="float",
                         kv_types=("q8_0", "q8_0"))
    logits = prefill(runner, 0, prompt)
    want = []
    for i in range(12):
        want.append(int(logits.argmax()))
        logits = prefill(runner, 0, prompt + want, start=len(prompt) + i)
    assert got == want


def test_bad_cache_types_are_one_line_errors() -> None:
    assert_clean_error(run_cli("serve", "-ctk", "q5_1"), "invalid choice: 'q5_1'")
    assert_clean_error(run_cli("generate", "-p", "hi", "-n", "1", "-ctv", "q4_0", "--remote", "unix:/nonexistent"),
                       "-ctk/-ctv")


def test_draft_model_has_its_own_types() -> None:
    """-ctkd/-ctvd give the draft's pool its types; each left out falls back to the target's -ctk/-ctv."""
    from specserve.cli import build_parser
    from specserve.cli.args import kv_types_from_args
    from specserve.engine.loading import load_with_draft

    args = build_parser().parse_args(["generate", "-p", "x", "-ctk", "q8_0", "-ctvd", "q4_0"])
    assert kv_types_from_args(args) == ("q8_0", None)
    assert kv_types_from_args(args, draft=True) == ("q8_0", "q4_0")
    target, draft, _ = load_with_draft("smollm2-135m", "smollm2-135m", n_seqs=1, n_ctx=128, device="cpu",
                                       progress=False, kv_types=("q8_0", None), draft_kv_types=("f16", "q4_0"))
    assert draft is not None
    assert [f.name for f in target.kv.formats] == ["q8_0", "compute"]  # type: ignore[attr-defined]
    assert [f.name for f in draft.kv.formats] == ["f16", "q4_0"]  # type: ignore[attr-defined]
