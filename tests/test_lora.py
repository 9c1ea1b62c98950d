"""LoRA adapters (model/lora.py, kernels/low_rank.py): a runner with an adapter at scale s gives the logits of the
same model with W + s * alpha / r * B A merged into its weights, per sequence, several adapters in one step."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from specserve.engine.local_runner import LocalRunner
from specserve.errors import NotSupported, SpecserveError
from specserve.kernels import settings as kernel_settings
from specserve.model.batch import Batch
from specserve.model.lora import attach_adapters, read_adapter
from tests.lora_files import write_adapter

PROMPTS = ([1, 504, 2014, 314, 253, 1127, 28, 29, 30], [1, 2870, 11, 1005, 418, 2136, 30])
ALPHA, RANK = 8.0, 4


@pytest.fixture(scope="module")
def adapters(smollm_path: Path, tmp_path_factory) -> tuple[Path, Path, dict, dict]:
    d = tmp_path_factory.mktemp("lora")
    one, two = d / "one.gguf", d / "two.gguf"
    return (one, two, write_adapter(one, smollm_path, rank=RANK, alpha=ALPHA, seed=1),
            write_adapter(two, smollm_path, rank=2 * RANK, alpha=0.0, seed=2, matrices=("attn_v", "ffn_up"),
                          output=False, std=0.02))


def float_runner(path: Path, adapters: list[Path] = (), **kw) -> LocalRunner:
    return LocalRunner(path, n_seqs=3, n_ctx=256, device="cpu", progress=False, weight_format="float",
                       adapters=adapters, **kw)


@pytest.fixture(scope="module")
def plain(smollm_path: Path) -> LocalRunner:
    return float_runner(smollm_path)


@pytest.fixture(scope="module")
def adapted(smollm_path: Path, adapters) -> LocalRunner:
    one, two, _, _ = adapters
    return float_runner(smollm_path, [one, two])


@contextmanager
def merged(runner: LocalRunner, pairs_and_factors: list[tuple[dict, float]]) -> Iterator[LocalRunner]:
    """The runner's model with each adapter's scaled B A added to its weights, while in the block."""
    cfg = runner.config
    q, kv = cfg.q_size, cfg.n_kv_heads * cfg.head_dim
    head = runner.model.head.head
    output = head.w
    changes = []
    for pairs, factor in pairs_and_factors:
        for name, (a, b) in pairs.items():
            delta = factor * (b @ a)
            if name == "output.weight":
                head.w = head.w + delta
                continue
            layer = runner.weights.layers[int(name.split(".")[1])]
            n = layer.w_gate_up.shape[0] // 2
            target, start = {"attn_q": (layer.wqkv, 0), "attn_k": (layer.wqkv, q), "attn_v": (layer.wqkv, q + kv),
                             "attn_output": (layer.wo, 0), "ffn_gate": (layer.w_gate_up, 0),
                             "ffn_up": (layer.w_gate_up, n), "ffn_down": (layer.w_down, 0)}[name.split(".")[2]]
            changes.append((target[start:start + delta.shape[0]], delta))
    with torch.inference_mode():
        for part, delta in changes:
            part += delta
    try:
        yield runner
    finally:
        with torch.inference_mode():
            for part, delta in changes:
                part -= delta
        head.w = output


def logits_of(runner: LocalRunner, seqs: dict[int, list[int]]) -> dict[int, torch.Tensor]:
    """Every row's logits, the sequences in one step."""
    batch = Batch()
    for seq, tokens in seqs.items():
        runner.kv_truncate(seq, 0)
        batch.add_sequence(tokens, 0, seq, "all")
    logits = runner.forward(batch)
    out, row = {}, 0
    for seq, tokens in seqs.items():
        out[seq] = logits[row:row + len(tokens)]
        row += len(tokens)
    return out


def test_adapter_equals_merged_weights_per_sequence(plain: LocalRunner, adapted: LocalRunner, adapters) -> None:
    _, _, pairs, _ = adapters
    adapted.set_adapter_scales(0, (0.7, 0.0))
    adapted.set_adapter_scales(1, ())
    got = logits_of(adapted, {0: PROMPTS[0], 1: PROMPTS[1]})
    base = logits_of(plain, {0: PROMPTS[0], 1: PROMPTS[1]})
    with merged(plain, [(pairs, 0.7 * ALPHA / RANK)]):
        want = logits_of(plain, {0: PROMPTS[0]})[0]
    torch.testing.assert_close(got[0], want, atol=2e-3, rtol=1e-4)
    torch.testing.assert_close(got[1], base[1], atol=1e-4, rtol=1e-5)
    assert (got[0] - base[0]).abs().max() > 1.0  # (the adapter matters)


def test_two_adapters_in_one_step(plain: LocalRunner, adapted: LocalRunner, adapters) -> None:
    """Alpha 0 takes the scale as it is (llama.cpp); each sequence its own mix of the two."""
    _, _, pairs_one, pairs_two = adapters
    adapted.set_adapter_scales(0, (1.0, 0.0))
    adapted.set_adapter_scales(1, (0.5, -1.5))
    adapted.set_adapter_scales(2, (0.0, 2.0))
    got = logits_of(adapted, {0: PROMPTS[0], 1: PROMPTS[1], 2: PROMPTS[0]})
    f = ALPHA / RANK
    want = {0: [(pairs_one, f)], 1: [(pairs_one, 0.5 * f), (pairs_two, -1.5)], 2: [(pairs_two, 2.0)]}
    for seq, mix in want.items():
        with merged(plain, mix):
            torch.testing.assert_close(got[seq], logits_of(plain, {0: PROMPTS[seq % 2]})[0], atol=2e-3, rtol=1e-4)


@pytest.fixture
def exact_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The CPU's exact fp32 packed products (SPECSERVE_CPU_EXACT=1) for one test."""
    monkeypatch.setenv("SPECSERVE_CPU_EXACT", "1")
    kernel_settings.reload()
    yield
    monkeypatch.delenv("SPECSERVE_CPU_EXACT")
    kernel_settings.reload()


def test_packed_weights_take_adapters(smollm_path: Path, adapted: LocalRunner, adapters, exact_cpu: None) -> None:
    """The CPU's packed-weight products take the adapters too: scale 0 is the plain model exactly, and a scale
    moves the logits as it moves the float model's (the exact fp32 products: the int8 ones round activations
    per word on AVX2 and per group on AVX-512, noise that does not cancel between the two runs)."""
    one, _, _, _ = adapters
    packed = LocalRunner(smollm_path, n_seqs=2, n_ctx=256, device="cpu", progress=False, weight_format="gguf",
                         adapters=[one])
    plain = LocalRunner(smollm_path, n_seqs=2, n_ctx=256, device="cpu", progress=False, weight_format="gguf")
    packed.set_adapter_scales(1, (1.0,))
    got = logits_of(packed, {0: PROMPTS[0], 1: PROMPTS[0]})
    torch.testing.assert_close(got[0], logits_of(plain, {0: PROMPTS[0]})[0], atol=0, rtol=0)
    adapted.set_adapter_scales(0, (1.0, 0.0))
    adapted.set_adapter_scales(1, ())
    moved = logits_of(adapted, {0: PROMPTS[0], 1: PROMPTS[0]})
    want, got_moved = moved[0] - moved[1], got[1] - got[0]
    assert want.abs().max() > 1.0
    assert (got_moved - want).norm() < 0.02 * want.norm()


def test_bad_adapter_files(smollm_path: Path, plain: LocalRunner, tmp_path: Path) -> None:
    def attach(path: Path) -> None:
        attach_adapters(plain.model, plain.config, [read_adapter(path)], plain.n_seqs)

    with pytest.raises(SpecserveError, match="not a LoRA adapter"):
        read_adapter(smollm_path)
    zeros = np.zeros
    cases = [  # (file's extra tensors, how it fails, the error)
        ({"token_embd.weight.lora_a": zeros((2, 576), np.float32), "token_embd.weight.lora_b": zeros((49152, 2),
          np.float32)}, attach, "attention and dense feed-forward matrices"),
        ({"blk.0.attn_q.weight.lora_a": zeros((2, 576), np.float32)}, read_adapter, "has no lora_b"),
        ({"blk.0.attn_q.weight.lora_a": zeros((2, 100), np.float32), "blk.0.attn_q.weight.lora_b": zeros((576, 2),
          np.float32)}, attach, "does not fit"),
    ]
    for i, (extra, use, message) in enumerate(cases):
        path = tmp_path / f"bad{i}.gguf"
        write_adapter(path, smollm_path, matrices=(), output=False, extra=extra)
        with pytest.raises(SpecserveError, match=message):
            use(path)
    assert plain.model.adapter_scales is None  # (a refused file attaches nothing)
    with pytest.raises(NotSupported, match="no LoRA adapters"):
        plain.set_adapter_scales(0, (1.0,))


def test_adapters_need_a_local_runner() -> None:
    from specserve.engine.loading import RemoteOptions, load_with_draft

    for where in ({"tensor_parallel": 2}, {"remote": RemoteOptions("unix:/nonexistent")}):
        with pytest.raises(NotSupported, match="not with --remote or --tensor-parallel"):
            load_with_draft("smollm2-135m", None, adapters=["x.gguf"], **where)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_adapters_in_cuda_graphs(smollm_path: Path, adapters) -> None:
    """On CUDA (bf16) the captured decode graphs read each row's scales: the same logits as eager steps, with and
    without adapters in one step."""
    one, two, _, _ = adapters
    kw = dict(n_seqs=3, n_ctx=256, device="cuda", progress=False, weight_format="float", adapters=[one, two])
    graphed, eager = LocalRunner(smollm_path, **kw), LocalRunner(smollm_path, cuda_graphs=False, **kw)
    assert graphed.graphs is not None
    graphed.warmup(max_rows=4, sequences=3)
    out = []
    for runner in (graphed, eager):
        runner.set_adapter_scales(0, (1.0, 0.5))
        runner.set_adapter_scales(2, (0.0, 2.0))  # seq 1: none
        for seq in range(3):
            logits_of(runner, {seq: PROMPTS[seq % 2]})
        batch = Batch()
        for seq in range(3):
            batch.add_row(7 + seq, len(PROMPTS[seq % 2]), seq, True)
        out.append(runner.forward(batch))
    torch.testing.assert_close(out[0], out[1], atol=0.1, rtol=0.02)
    # seq 1 has no scales: the base model's row, on the same rows (bf16 products of another row count round apart)
    plain = LocalRunner(smollm_path, n_seqs=3, n_ctx=256, device="cuda", progress=False, weight_format="float",
                        cuda_graphs=False)
    for seq in range(3):
        logits_of(plain, {seq: PROMPTS[seq % 2]})
    torch.testing.assert_close(out[1][1], plain.forward(batch)[1], atol=0, rtol=0)
    assert (out[0][0] - out[0][1]).abs().max() > 1.0
