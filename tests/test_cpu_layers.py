"""A CPU step's layers in one C call (kernels/cpu_layers.py) against the op-by-op path on the same packed model:
the same logits and the same KV cache, bit for bit, for a prompt chunk and decode steps of two sequences, with and
without q/k/v biases, 4- and 8-bit weights, fp32 and fp16 caches; and which models it takes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from specserve.gguf.reader import GGUFFile
from specserve.kernels import settings as kernel_settings
from specserve.kernels.backend import kernels_for
from specserve.kernels.cpu import build
from specserve.kernels.cpu_layers import WholeLayers
from specserve.kernels.kv_format import kv_format
from specserve.model.kv_cache import PagedKV
from specserve.model.registry import read_config
from specserve.model.transformer import Transformer
from specserve.model.weights import load_weights
from tests.moe_gguf import quantize_gguf
from tests.test_model_families import HEAD_DIM, N_KV_HEADS, N_LAYERS, write_model

pytestmark = pytest.mark.skipif(not build.has("cpu_layers"),
                                reason="needs a C compiler and AVX2 (+FMA, F16C) or AVX-512 VNNI")


def _model(tmp_path: Path, arch: str, weight_format: str) -> Transformer:
    """A tiny random model of arch; weight_format "q4_1": its file's matrices in Q4_1, kept packed."""
    path = tmp_path / f"{arch}.gguf"
    write_model(path, arch)
    if weight_format == "q4_1":
        path = quantize_gguf(path, tmp_path / f"{arch}-q4_1.gguf", lambda name: GGMLQuantizationType.Q4_1)
        weight_format = "gguf"
    gguf = GGUFFile(path)
    cfg = read_config(gguf.metadata, set(gguf.tensor_names()))
    weights = load_weights(gguf, cfg, torch.float32, "cpu", progress=False, weight_format=weight_format)
    return Transformer(cfg, weights, 64, kernels_for("cpu"))


def _steps(model: Transformer, cache_type: str) -> tuple[list[torch.Tensor], PagedKV]:
    """A 6-token prompt of sequence 0, then 3 steps of one row each of sequences 0 and 1 (1 primed by a prompt of
    3): every step's logits, and the cache."""
    fmt = kv_format(cache_type)
    kv = PagedKV(N_LAYERS, N_KV_HEADS, HEAD_DIM, n_blocks=8, n_seqs=2, n_ctx=64, block_size=8,
                 dtype=torch.float32, device=torch.device("cpu"), formats=(fmt, fmt))
    out = []

    def step(tokens: list[int], positions: list[int], seqs: list[int], slots: list[int]) -> None:
        pos, seq = torch.tensor(positions), torch.tensor(seqs)
        out.append(model.forward(torch.tensor(tokens), pos, seq, None, [], kv.step(torch.tensor(slots))))

    step([3, 1, 4, 1, 5, 9], list(range(6)), [0] * 6, [16 + i for i in range(6)])
    step([2, 6, 5], [0, 1, 2], [1] * 3, [40, 41, 42])
    for i in range(3):
        step([7 + i, 11 + i], [6 + i, 3 + i], [0, 1], [22 + i, 43 + i])
    return out, kv


@pytest.mark.parametrize(("arch", "weight_format", "cache_type"),
                         [("qwen2", "q8", "f32"), ("llama", "q8", "f16"), ("qwen2", "q4_1", "f32")])
def test_whole_layers_equal_the_ops_bit_for_bit(arch: str, weight_format: str, cache_type: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(tmp_path, arch, weight_format)
    assert isinstance(model.whole_layers, WholeLayers)
    calls = []
    original = WholeLayers.__call__

    def spy(self: WholeLayers, *args: object) -> bool:
        calls.append(original(self, *args))  # type: ignore[arg-type]
        return calls[-1]

    monkeypatch.setattr(WholeLayers, "__call__", spy)
    whole, whole_kv = _steps(model, cache_type)
    assert calls == [True] * 5
    monkeypatch.setenv("SPECSERVE_CPU_LAYERS", "0")
    kernel_settings.reload()
    try:
        ops, ops_kv = _steps(model, cache_type)
    finally:
        monkeypatch.delenv("SPECSERVE_CPU_LAYERS")
        kernel_settings.reload()
    assert calls[5:] == [False] * 5
    assert all(torch.equal(a, b) for a, b in zip(whole, ops, strict=True))
    for (k, v), (k_ops, v_ops) in zip(whole_kv.layers, ops_kv.layers, strict=True):
        assert torch.equal(k, k_ops) and torch.equal(v, v_ops)
    assert all(torch.isfinite(x).all() for x in whole)


def test_only_dense_packed_models_are_taken(tmp_path: Path) -> None:
    assert _model(tmp_path, "qwen2", "float").whole_layers is None  # float matrices: torch's products
    assert _model(tmp_path, "qwen3", "q8").whole_layers is None  # per-head q/k norms
