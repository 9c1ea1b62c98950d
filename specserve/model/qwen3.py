"""qwen3: Qwen3 (dense).

RoPE rotates the two halves of each head ("neox"); no q/k/v biases, but an RMSNorm over each q and k
head before RoPE (the attn_q_norm / attn_k_norm tensors), which the attention block applies."""

from __future__ import annotations

from typing import Any

from specserve.model.blocks import dense_layer
from specserve.model.config import ModelConfig, decoder_fields


def read_config(metadata: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    return ModelConfig(**decoder_fields(metadata, tensor_names), rope_style="neox")


decoder_layer = dense_layer
