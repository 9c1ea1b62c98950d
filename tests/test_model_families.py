"""The architecture registry: each family reads its GGUF config and builds its layers; others are refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter

from specserve.errors import SpecserveError
from specserve.gguf.reader import GGUFFile
from specserve.kernels.backend import kernels_for
from specserve.model.kv_cache import PagedKV
from specserve.model.registry import FAMILIES, family, read_config
from specserve.model.transformer import Transformer
from specserve.model.weights import load_weights

HIDDEN, N_HEADS, N_KV_HEADS, HEAD_DIM, FFN, VOCAB, N_LAYERS = 64, 4, 2, 16, 96, 40, 2
# arch -> (rope style, q/k/v biases, per-head q/k norms) as its family reads them
FEATURES = {"llama": ("interleaved", False, False), "qwen2": ("neox", True, False), "qwen3": ("neox", False, True)}


def write_model(path: Path, arch: str) -> None:
    """A tiny random model in `arch`'s GGUF layout (tied embeddings: no output.weight)."""
    _, bias, qk_norm = FEATURES[arch]
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(N_LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(N_HEADS)
    writer.add_head_count_kv(N_KV_HEADS)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB)

    def add(name: str, *shape: int) -> None:
        scale = 1.0 if len(shape) == 1 else shape[-1] ** -0.5
        base = 1.0 if len(shape) == 1 and name.endswith("norm.weight") else 0.0
        writer.add_tensor(name, (base + scale * rng.standard_normal(shape)).astype(np.float32))

    add("token_embd.weight", VOCAB, HIDDEN)
    add("output_norm.weight", HIDDEN)
    q, kv = N_HEADS * HEAD_DIM, N_KV_HEADS * HEAD_DIM
    for i in range(N_LAYERS):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", HIDDEN)
        for name, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            add(p + name + ".weight", rows, HIDDEN)
            if bias:
                add(p + name + ".bias", rows)
        if qk_norm:
            add(p + "attn_q_norm.weight", HEAD_DIM)
            add(p + "attn_k_norm.weight", HEAD_DIM)
        add(p + "attn_output.weight", HIDDEN, q)
        add(p + "ffn_norm.weight", HIDDEN)
        add(p + "ffn_gate.weight", FFN, HIDDEN)
        add(p + "ffn_up.weight", FFN, HIDDEN)
        add(p + "ffn_down.weight", HIDDEN, FFN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_registry_lists_the_families() -> None:
    assert set(FAMILIES) == set(FEATURES) | {"qwen2moe", "qwen3moe"}  # (the MoE ones: tests/test_moe_models.py)


def test_unknown_architecture_is_refused_by_name() -> None:
    message = "unsupported model architecture 'gpt2' (supported: llama, qwen2, qwen3, qwen2moe, qwen3moe)"
    with pytest.raises(SpecserveError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_config({"general.architecture": "gpt2"}, set())
    with pytest.raises(SpecserveError, match="unsupported model architecture 'None'"):
        family(None)


@pytest.mark.parametrize("arch", sorted(FEATURES))
def test_family_reads_its_config_and_runs(arch: str, tmp_path: Path) -> None:
    path = tmp_path / f"{arch}.gguf"
    write_model(path, arch)
    gguf = GGUFFile(path)
    cfg = read_config(gguf.metadata, set(gguf.tensor_names()))
    rope_style, bias, qk_norm = FEATURES[arch]
    assert (cfg.arch, cfg.rope_style, cfg.qkv_bias, cfg.qk_norm) == (arch, rope_style, bias, qk_norm)
    assert (cfg.n_layers, cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn, cfg.vocab_size) == (
        N_LAYERS, HIDDEN, N_HEADS, N_KV_HEADS, HEAD_DIM, FFN, VOCAB)
    assert (cfg.rope_dim, cfg.rope_base, cfg.tied_embeddings) == (HEAD_DIM, 50000.0, True)
    assert cfg.rms_eps == pytest.approx(1e-6)  # stored as float32

    weights = load_weights(gguf, cfg, torch.float32, "cpu", progress=False)
    model = Transformer(cfg, weights, 32, kernels_for("cpu"))
    qkv = model.layers[0].attention.qkv
    assert (qkv.bias is not None, qkv.head_norms is not None, qkv.style) == (bias, qk_norm, rope_style)
    kv = PagedKV(N_LAYERS, N_KV_HEADS, HEAD_DIM, n_blocks=2, n_seqs=1, n_ctx=32, block_size=16,
                 dtype=torch.float32, device=torch.device("cpu"))
    positions = torch.arange(5)
    logits = model.forward(torch.tensor([3, 1, 4, 1, 5]), positions, torch.zeros(5, dtype=torch.long), None,
                           [(0, 0, 5, 5)], kv.step(positions + 16))
    assert logits.shape == (5, VOCAB) and logits.dtype == torch.float32 and torch.isfinite(logits).all()
    # The prompt's last row again as a decode step over the cached prefix: the same logits.
    step = model.forward(torch.tensor([5]), positions[4:], torch.zeros(1, dtype=torch.long), None,
                         [(0, 0, 1, 5)], kv.step(positions[4:] + 16))
    torch.testing.assert_close(step[0], logits[4], rtol=1e-5, atol=1e-5)
