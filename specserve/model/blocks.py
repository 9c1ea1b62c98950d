"""The blocks decoder families stack: embedding, attention, the dense SwiGLU feed-forward, the output head.

Each block is written once over the kernels' decoder-step ops (kernels.step_ops: NormQKVRope, LinearAdd,
NormFeedForwardAdd, NormLinear) on the step's ResidualStream; the ops, not the blocks, pick fused kernels
or the reference composition. A family that differs in one block (a mixture of experts' feed-forward)
brings that block and reuses the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from specserve.kernels.rope import rope_cos_sin
from specserve.kernels.step_ops import LinearAdd, NormFeedForwardAdd, NormLinear, NormQKVRope, ResidualStream, StepOp
from specserve.model.config import ModelConfig
from specserve.model.kv_cache import KVStep
from specserve.model.weights import LayerWeights, ModelWeights

Runs = list[tuple[int, int, int, int]]  # Batch.runs(): (seq, start_row, end_row, kv_len)


def embed(tokens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Token ids -> rows of the embedding table: the residual stream's start."""
    return F.embedding(tokens, table)


@dataclass(frozen=True)
class RopeTables:
    """cos and sin per position (rope_cos_sin), shared by every layer."""

    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def for_config(cls, config: ModelConfig, max_positions: int, device: torch.device) -> RopeTables:
        return cls(*rope_cos_sin(config.rope_dim, config.rope_base, max_positions, config.rope_scale, device))


class AttentionBlock:
    """RMSNorm -> QKV product (+ bias) -> q/k head norms (when the weights have them) -> RoPE with the KV
    write -> attention over the layer's cache -> output product, added to the residual stream."""

    def __init__(self, config: ModelConfig, layer_idx: int, lw: LayerWeights, rope: RopeTables) -> None:
        self.layer_idx = layer_idx
        head_norms = (lw.q_norm, lw.k_norm) if lw.q_norm is not None and lw.k_norm is not None else None
        self.qkv = NormQKVRope(lw.attn_norm, config.rms_eps, lw.wqkv, lw.bqkv, head_norms, rope.cos, rope.sin,
                               config.rope_style, config.n_heads, config.n_kv_heads, config.head_dim)
        self.out = LinearAdd(lw.wo)
        self.q_size = config.q_size
        self.scale = config.head_dim ** -0.5

    def ops(self) -> list[StepOp]:
        return [self.qkv, self.out]

    def __call__(self, stream: ResidualStream, positions: torch.Tensor, seq_ids: torch.Tensor, runs: Runs,
                 kv: KVStep) -> None:
        k_cache, v_cache = kv.layers[self.layer_idx]
        q = self.qkv(stream, kv.rope_positions(positions), kv.slots, k_cache, v_cache)
        attn = stream.kernels.attention(q, k_cache, v_cache, positions, seq_ids, kv.table, runs, self.scale,
                                        kv.hidden, kv.prompt)
        self.out(stream, attn.view(q.shape[0], self.q_size))


class FeedForward(Protocol):
    """A feed-forward block: reads the residual stream's RMSNorm and adds its output to the stream."""

    def ops(self) -> list[StepOp]: ...

    def __call__(self, stream: ResidualStream) -> None: ...


class DenseFeedForward:
    """RMSNorm -> [gate | up] product -> SwiGLU -> down product, added to the residual stream."""

    def __init__(self, config: ModelConfig, lw: LayerWeights) -> None:
        assert lw.w_gate_up is not None and lw.w_down is not None, "a dense layer's feed-forward matrices"
        self.ffn = NormFeedForwardAdd(lw.ffn_norm, config.rms_eps, lw.w_gate_up, lw.w_down)

    def ops(self) -> list[StepOp]:
        return [self.ffn]

    def __call__(self, stream: ResidualStream) -> None:
        self.ffn(stream)


@dataclass
class DecoderLayer:
    """Attention, then the feed-forward block: each adds its output to the residual stream."""

    attention: AttentionBlock
    feed_forward: FeedForward

    def ops(self) -> list[StepOp]:
        return self.attention.ops() + self.feed_forward.ops()

    def __call__(self, stream: ResidualStream, positions: torch.Tensor, seq_ids: torch.Tensor, runs: Runs,
                 kv: KVStep) -> None:
        self.attention(stream, positions, seq_ids, runs, kv)
        self.feed_forward(stream)


class OutputHead:
    """Final RMSNorm -> output product: fp32 logits."""

    def __init__(self, config: ModelConfig, weights: ModelWeights) -> None:
        self.head = NormLinear(weights.out_norm, config.rms_eps, weights.output, torch.float32)

    def __call__(self, stream: ResidualStream) -> torch.Tensor:
        return self.head(stream)

    def normed(self, stream: ResidualStream) -> torch.Tensor:
        """The final RMSNorm only: the hidden state the logits are computed from."""
        return stream.normed(self.head.norm, self.head.eps)
