"""The decoder-only transformer (llama / qwen2 / qwen3) over a slot-major KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.kernels.attention import attention
from specserve.kernels.linear import feed_forward, linear
from specserve.kernels.rmsnorm import add_rms_norm, rms_norm
from specserve.kernels.rope import rope_and_cache, rope_cos_sin
from specserve.model.config import ModelConfig
from specserve.model.weights import ModelWeights


class Transformer:
    """Stateless forward over given weights; the KV cache is passed in by the runner."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, max_positions: int):
        self.config = config
        self.weights = weights
        device = weights.embed.device
        self.cos, self.sin = rope_cos_sin(config.rope_dim, config.rope_base, max_positions,
                                          config.rope_scale, device)
        self.scale = config.head_dim ** -0.5

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        seq_ids: torch.Tensor,
        logit_rows: torch.Tensor | None,
        runs: list[tuple[int, int, int, int]],
        kv: torch.Tensor,
    ) -> torch.Tensor:
        """Hidden states of `tokens` -> fp32 logits of `logit_rows` (None: all rows); writes K/V into `kv`.

        kv: [n_layers, 2, n_seqs, n_kv_heads, ctx, head_dim]. `runs` comes from Batch.runs().
        """
        cfg = self.config
        w = self.weights
        n = tokens.shape[0]
        x = F.embedding(tokens, w.embed)
        residual: torch.Tensor | None = None
        for layer_idx, lw in enumerate(w.layers):
            if residual is None:  # first layer: the residual stream starts as the embedding
                h, residual = rms_norm(x, lw.attn_norm, cfg.rms_eps), x
            else:
                h, residual = add_rms_norm(x, residual, lw.attn_norm, cfg.rms_eps)
            qkv = linear(h, lw.wqkv, lw.bqkv)
            q = qkv[:, : cfg.q_size].view(n, cfg.n_heads, cfg.head_dim)
            k = qkv[:, cfg.q_size : cfg.q_size + cfg.kv_size].view(n, cfg.n_kv_heads, cfg.head_dim)
            v = qkv[:, cfg.q_size + cfg.kv_size :].view(n, cfg.n_kv_heads, cfg.head_dim)
            if lw.q_norm is not None:
                q = rms_norm(q, lw.q_norm, cfg.rms_eps)
                k = rms_norm(k, lw.k_norm, cfg.rms_eps)
            k_cache, v_cache = kv[layer_idx, 0], kv[layer_idx, 1]
            q = rope_and_cache(q, k, v, self.cos, self.sin, positions, seq_ids, k_cache, v_cache, cfg.rope_style)
            attn = attention(q, k_cache, v_cache, positions, seq_ids, runs, self.scale)
            x = linear(attn.view(n, cfg.q_size), lw.wo)
            h, residual = add_rms_norm(x, residual, lw.ffn_norm, cfg.rms_eps)
            x = feed_forward(h, lw.w_gate_up, lw.w_down)
        assert residual is not None, "a model has at least one layer"
        if logit_rows is not None:
            x, residual = x[logit_rows], residual[logit_rows]
        h, _ = add_rms_norm(x, residual, w.out_norm, cfg.rms_eps)
        return linear(h, w.output, out_dtype=torch.float32)
