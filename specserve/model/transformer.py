"""The decoder-only transformer (llama / qwen2 / qwen3) over a slot-major KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.kernels.attention import attention
from specserve.kernels.linear import QuantWeight, feed_forward, fusable, linear, linear_fused
from specserve.kernels.rmsnorm import add_rms_norm, rms_norm
from specserve.kernels.rope import RopeWrite, rope_and_cache, rope_cos_sin
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
        self._fusion: dict[int, bool] = {}  # row count -> whether forward takes the fused path

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
        x = F.embedding(tokens, w.embed)
        if self._fusable(x):
            return self._forward_fused(x, positions, seq_ids, logit_rows, runs, kv)
        residual: torch.Tensor | None = None
        for layer_idx, lw in enumerate(w.layers):
            if residual is None:  # first layer: the residual stream starts as the embedding
                h, residual = rms_norm(x, lw.attn_norm, cfg.rms_eps), x
            else:
                h, residual = add_rms_norm(x, residual, lw.attn_norm, cfg.rms_eps)
            qkv = linear(h, lw.wqkv, lw.bqkv)
            attn = self._attention(qkv, layer_idx, positions, seq_ids, runs, kv)
            x = linear(attn, lw.wo)
            h, residual = add_rms_norm(x, residual, lw.ffn_norm, cfg.rms_eps)
            x = feed_forward(h, lw.w_gate_up, lw.w_down)
        assert residual is not None, "a model has at least one layer"
        if logit_rows is not None:
            x, residual = x[logit_rows], residual[logit_rows]
        h, _ = add_rms_norm(x, residual, w.out_norm, cfg.rms_eps)
        return linear(h, w.output, out_dtype=torch.float32)

    def _forward_fused(self, residual: torch.Tensor, positions: torch.Tensor, seq_ids: torch.Tensor,
                       logit_rows: torch.Tensor | None, runs: list[tuple[int, int, int, int]],
                       kv: torch.Tensor) -> torch.Tensor:
        """forward() with each RMSNorm folded into the product after it, RoPE and the KV-cache write into
        the QKV product, and each sub-layer's output added to the residual stream by the product that
        makes it (in place): no norm or RoPE kernels."""
        cfg = self.config
        w = self.weights
        n = residual.shape[0]
        for layer_idx, lw in enumerate(w.layers):
            assert isinstance(lw.wqkv, QuantWeight) and isinstance(lw.wo, QuantWeight)
            k_cache, v_cache = kv[layer_idx, 0], kv[layer_idx, 1]
            rope = RopeWrite(self.cos, self.sin, positions, seq_ids, k_cache, v_cache, cfg.n_heads, cfg.n_kv_heads,
                             cfg.rope_style)
            q = linear_fused(residual, lw.wqkv, lw.bqkv, norm=(lw.attn_norm, cfg.rms_eps), rope=rope)
            attn = attention(q.view(n, cfg.n_heads, cfg.head_dim), k_cache, v_cache, positions, seq_ids, runs,
                             self.scale)
            linear_fused(attn.view(n, cfg.q_size), lw.wo, add_to=residual)
            feed_forward(residual, lw.w_gate_up, lw.w_down, norm=(lw.ffn_norm, cfg.rms_eps), add_to=residual)
        if logit_rows is not None:
            residual = residual[logit_rows]
        if fusable(residual, w.output, norm_input=True):
            assert isinstance(w.output, QuantWeight)
            return linear_fused(residual, w.output, norm=(w.out_norm, cfg.rms_eps), out_dtype=torch.float32)
        return linear(rms_norm(residual, w.out_norm, cfg.rms_eps), w.output, out_dtype=torch.float32)

    def _fusable(self, x: torch.Tensor) -> bool:
        """Whether every layer's products run on the tensor-core kernel with RMSNorm, RoPE and the residual
        adds folded in (decode and verify steps over packed weights); fixed per row count."""
        rows = x.shape[0]
        cfg = self.config
        if rows not in self._fusion:
            rope_ok = (cfg.rope_dim == cfg.head_dim and cfg.head_dim % 16 == 0 and not cfg.qk_norm
                       and cfg.rope_style in ("neox", "interleaved"))
            self._fusion[rows] = rope_ok and all(
                fusable(x, lw.wqkv, norm_input=True) and fusable(x, lw.wo) and fusable(x, lw.w_gate_up, norm_input=True)
                and fusable(x, lw.w_down) and lw.w_gate_up.shape[0] % 16 == 0
                and all(t.dtype == torch.bfloat16 for t in (lw.attn_norm, lw.ffn_norm, self.weights.out_norm))
                for lw in self.weights.layers)
        return self._fusion[rows]

    def _attention(self, qkv: torch.Tensor, layer_idx: int, positions: torch.Tensor, seq_ids: torch.Tensor,
                   runs: list[tuple[int, int, int, int]], kv: torch.Tensor) -> torch.Tensor:
        """Rows of [q | k | v] -> attention output [rows, q_size]; k and v enter the layer's cache."""
        cfg = self.config
        lw = self.weights.layers[layer_idx]
        n = qkv.shape[0]
        q = qkv[:, : cfg.q_size].view(n, cfg.n_heads, cfg.head_dim)
        k = qkv[:, cfg.q_size : cfg.q_size + cfg.kv_size].view(n, cfg.n_kv_heads, cfg.head_dim)
        v = qkv[:, cfg.q_size + cfg.kv_size :].view(n, cfg.n_kv_heads, cfg.head_dim)
        if lw.q_norm is not None:
            q = rms_norm(q, lw.q_norm, cfg.rms_eps)
            k = rms_norm(k, lw.k_norm, cfg.rms_eps)
        k_cache, v_cache = kv[layer_idx, 0], kv[layer_idx, 1]
        q = rope_and_cache(q, k, v, self.cos, self.sin, positions, seq_ids, k_cache, v_cache, cfg.rope_style)
        return attention(q, k_cache, v_cache, positions, seq_ids, runs, self.scale).view(n, cfg.q_size)
