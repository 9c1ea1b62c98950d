"""llama: the GGUF architecture of Llama and of models converted as it (SmolLM2, Mistral, ...).

llama.cpp's converter permutes Q and K so that RoPE rotates adjacent pairs ("interleaved"). The
q/k/v biases some llama files carry are read when present (config.decoder_fields)."""

from __future__ import annotations

from typing import Any

from specserve.model.blocks import dense_layer
from specserve.model.config import ModelConfig, decoder_fields


def read_config(metadata: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    return ModelConfig(**decoder_fields(metadata, tensor_names), rope_style="interleaved")


decoder_layer = dense_layer
