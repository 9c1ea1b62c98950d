"""Random weights in a real model's shapes: speed tests without moving the weight file.

Speed does not depend on weight values, so the GPU benchmarks can build the model on the
device in the exact shapes of a catalog model.
"""

from __future__ import annotations

import torch

from specserve.model.config import ModelConfig
from specserve.model.weights import LayerWeights, ModelWeights

# Shapes of the catalog models (from their GGUF metadata), for when the file is absent.
SHAPES: dict[str, ModelConfig] = {
    "qwen2.5-coder-1.5b": ModelConfig(
        arch="qwen2", n_layers=28, hidden=1536, n_heads=12, n_kv_heads=2, head_dim=128, ffn=8960,
        vocab_size=151936, context_length=32768, rope_base=1e6, rope_dim=128, rope_style="neox",
        rope_scale=1.0, rms_eps=1e-6, tied_embeddings=False, qkv_bias=True, qk_norm=False,
    ),
    "qwen2.5-coder-0.5b": ModelConfig(
        arch="qwen2", n_layers=24, hidden=896, n_heads=14, n_kv_heads=2, head_dim=64, ffn=4864,
        vocab_size=151936, context_length=32768, rope_base=1e6, rope_dim=64, rope_style="neox",
        rope_scale=1.0, rms_eps=1e-6, tied_embeddings=False, qkv_bias=True, qk_norm=False,
    ),
    "smollm2-135m": ModelConfig(
        arch="llama", n_layers=30, hidden=576, n_heads=9, n_kv_heads=3, head_dim=64, ffn=1536,
        vocab_size=49152, context_length=8192, rope_base=1e5, rope_dim=64, rope_style="interleaved",
        rope_scale=1.0, rms_eps=1e-5, tied_embeddings=True, qkv_bias=False, qk_norm=False,
    ),
}


def random_weights(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, seed: int = 0) -> ModelWeights:
    gen = torch.Generator(device=device).manual_seed(seed)

    def mat(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen, device=device) * cols ** -0.5).to(dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=dtype)

    qkv_rows = cfg.q_size + 2 * cfg.kv_size
    layers = [
        LayerWeights(
            attn_norm=ones(cfg.hidden), wqkv=mat(qkv_rows, cfg.hidden),
            bqkv=(torch.randn(qkv_rows, generator=gen, device=device) * 0.1).to(dtype) if cfg.qkv_bias else None,
            q_norm=ones(cfg.head_dim) if cfg.qk_norm else None, k_norm=ones(cfg.head_dim) if cfg.qk_norm else None,
            wo=mat(cfg.hidden, cfg.q_size), ffn_norm=ones(cfg.hidden), w_gate_up=mat(2 * cfg.ffn, cfg.hidden),
            w_down=mat(cfg.hidden, cfg.ffn),
        )
        for _ in range(cfg.n_layers)
    ]
    embed = mat(cfg.vocab_size, cfg.hidden)
    output = embed if cfg.tied_embeddings else mat(cfg.vocab_size, cfg.hidden)
    return ModelWeights(embed=embed, layers=layers, out_norm=ones(cfg.hidden), output=output)
