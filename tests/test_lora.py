"""LoRA adapters (model/lora.py, kernels/low_rank.py): a runner with an adapter at scale s gives the logits of the
same model with W + s * alpha / r * B A merged into its weights, per sequence, several adapters in one step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from specserve.engine.local_runner import LocalRunner
from specserve.errors import NotSupported, SpecserveError
from specserve.model.batch import Batch
from specserve.model.lora import read_adapter
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


def _runner(path: Path, adapters: list[Path] = (), **kw) -> LocalRunner:
    return LocalRunner(path, n_seqs=3, n_ctx=256, device="cpu", progress=False, weight_format="float",
                       adapters=adapters, **kw)


def _merged(path: Path, pairs_and_factors: list[tuple[dict, float]]) -> LocalRunner:
    """The model with each adapter's scaled B A added to its weights."""
    runner = _runner(path)
    cfg = runner.config
    q, kv = cfg.q_size, cfg.n_kv_heads * cfg.head_dim
    with torch.inference_mode():
        for pairs, factor in pairs_and_factors:
            for name, (a, b) in pairs.items():
                delta = factor * (b @ a)
                if name == "output.weight":
                    head = runner.model.head.head
                    head.w = head.w + delta
                    continue
                layer = runner.weights.layers[int(name.split(".")[1])]
                n = layer.w_gate_up.shape[0] // 2
                part = name.split(".")[2]
                target, start = {"attn_q": (layer.wqkv, 0), "attn_k": (layer.wqkv, q), "attn_v": (layer.wqkv, q + kv),
                                 "attn_output": (layer.wo, 0), "ffn_gate": (layer.w_gate_up, 0),
                                 "ffn_up": (layer.w_gate_up, n), "ffn_down": (layer.w_down, 0)}[part]
                target[start:start + delta.shape[0]] += delta
    return runner


def _logits(runner: LocalRunner, seqs: dict[int, list[int]]) -> dict[int, torch.Tensor]:
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


def test_adapter_equals_merged_weights_per_sequence(smollm_path: Path, adapters) -> None:
    one, _, pairs, _ = adapters
    runner = _runner(smollm_path, [one])
    runner.set_adapter_scales(0, (0.7,))  # seq 1: no scales (0)
    got = _logits(runner, {0: PROMPTS[0], 1: PROMPTS[1]})
    merged = _logits(_merged(smollm_path, [(pairs, 0.7 * ALPHA / RANK)]), {0: PROMPTS[0]})[0]
    base = _logits(_runner(smollm_path), {1: PROMPTS[1]})[1]
    assert (merged - base[:1].mean()).abs().max() > 0  # (the adapter matters)
    torch.testing.assert_close(got[0], merged, atol=2e-3, rtol=1e-4)
    torch.testing.assert_close(got[1], base, atol=1e-4, rtol=1e-5)
    assert (got[0] - _logits(_runner(smollm_path), {0: PROMPTS[0]})[0]).abs().max() > 1.0


def test_two_adapters_in_one_step(smollm_path: Path, adapters) -> None:
    """Alpha 0 takes the scale as it is (llama.cpp); each sequence its own mix of the two."""
    one, two, pairs_one, pairs_two = adapters
    runner = _runner(smollm_path, [one, two])
    runner.set_adapter_scales(0, (1.0, 0.0))
    runner.set_adapter_scales(1, (0.5, -1.5))
    runner.set_adapter_scales(2, (0.0, 2.0))
    got = _logits(runner, {0: PROMPTS[0], 1: PROMPTS[1], 2: PROMPTS[0]})
    f = ALPHA / RANK
    want = {0: [(pairs_one, f)], 1: [(pairs_one, 0.5 * f), (pairs_two, -1.5)], 2: [(pairs_two, 2.0)]}
    for seq, mix in want.items():
        prompt = PROMPTS[seq % 2]
        torch.testing.assert_close(got[seq], _logits(_merged(smollm_path, mix), {0: prompt})[0], atol=2e-3, rtol=1e-4)


def test_greedy_decode_with_packed_weights(smollm_path: Path, adapters) -> None:
    """The CPU's packed-weight products take the adapters too: scale 0 is the plain model exactly, and a scale
    moves the logits as it moves the float model's."""
    one, _, _, _ = adapters
    packed = LocalRunner(smollm_path, n_seqs=2, n_ctx=256, device="cpu", progress=False, weight_format="gguf",
                         adapters=[one])
    plain = LocalRunner(smollm_path, n_seqs=2, n_ctx=256, device="cpu", progress=False, weight_format="gguf")
    packed.set_adapter_scales(1, (1.0,))
    got = _logits(packed, {0: PROMPTS[0], 1: PROMPTS[0]})
    torch.testing.assert_close(got[0], _logits(plain, {0: PROMPTS[0]})[0], atol=0, rtol=0)
    float_runner = _runner(smollm_path, [one])
    float_runner.set_adapter_scales(0, (1.0,))
    moved = _logits(float_runner, {0: PROMPTS[0], 1: PROMPTS[0]})
    want, got_moved = moved[0] - moved[1], got[1] - got[0]
    assert want.abs().max() > 1.0
    assert (got_moved - want).norm() < 0.25 * want.norm()  # (packed products round activations to int8: ~0.14)


def test_bad_adapter_files(smollm_path: Path, tmp_path: Path) -> None:
    with pytest.raises(SpecserveError, match="not a LoRA adapter"):
        read_adapter(smollm_path)
    bad = tmp_path / "embd.gguf"
    write_adapter(bad, smollm_path, matrices=(), output=False,
                  extra={"token_embd.weight.lora_a": np.zeros((2, 576), np.float32),
                         "token_embd.weight.lora_b": np.zeros((49152, 2), np.float32)})
    with pytest.raises(SpecserveError, match="attention and dense feed-forward matrices"):
        _runner(smollm_path, [bad])
    lonely = tmp_path / "lonely.gguf"
    write_adapter(lonely, smollm_path, matrices=(), output=False,
                  extra={"blk.0.attn_q.weight.lora_a": np.zeros((2, 576), np.float32)})
    with pytest.raises(SpecserveError, match="has no lora_b"):
        read_adapter(lonely)
    wrong = tmp_path / "wrong.gguf"
    write_adapter(wrong, smollm_path, matrices=(), output=False,
                  extra={"blk.0.attn_q.weight.lora_a": np.zeros((2, 100), np.float32),
                         "blk.0.attn_q.weight.lora_b": np.zeros((576, 2), np.float32)})
    with pytest.raises(SpecserveError, match="does not fit"):
        _runner(smollm_path, [wrong])
    with pytest.raises(NotSupported, match="no LoRA adapters"):
        _runner(smollm_path).set_adapter_scales(0, (1.0,))


def test_adapters_need_a_local_runner() -> None:
    from specserve.engine.loading import RemoteOptions, load_with_draft

    for where in ({"tensor_parallel": 2}, {"remote": RemoteOptions("unix:/nonexistent")}):
        with pytest.raises(NotSupported, match="not with --remote or --tensor-parallel"):
            load_with_draft("smollm2-135m", None, adapters=["x.gguf"], **where)
