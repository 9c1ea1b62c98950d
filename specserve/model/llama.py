"""llama: the GGUF architecture of Llama and of models converted as it (SmolLM2, Mistral, Mixtral, ...).

llama.cpp's converter permutes Q and K so that RoPE rotates adjacent pairs ("interleaved"). The
q/k/v biases some llama files carry are read when present (config.decoder_fields). A file with stacked
expert tensors (ffn_gate_exps: Mixtral) has mixture-of-experts layers: softmax over the router's logits,
top k, the k weights divided by their sum."""

from __future__ import annotations

from typing import Any

from specserve.model import moe
from specserve.model.config import ModelConfig, decoder_fields
from specserve.model.weights import is_moe_layer


def read_config(metadata: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    if is_moe_layer(tensor_names, 0):
        return moe.read_moe_config(metadata, tensor_names, rope_style="interleaved", weights_norm=True)
    return ModelConfig(**decoder_fields(metadata, tensor_names), rope_style="interleaved")


decoder_layer = moe.decoder_layer  # dense layers where the file has no experts
