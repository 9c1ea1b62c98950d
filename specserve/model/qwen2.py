"""qwen2: Qwen2 / Qwen2.5 (and their coder models).

RoPE rotates the two halves of each head ("neox"); the Q, K and V products carry biases (the
attn_q/k/v.bias tensors), which the attention block adds."""

from __future__ import annotations

from typing import Any

from specserve.model.blocks import dense_layer
from specserve.model.config import ModelConfig, decoder_fields


def read_config(metadata: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    return ModelConfig(**decoder_fields(metadata, tensor_names), rope_style="neox")


decoder_layer = dense_layer
