"""Architecture name (GGUF general.architecture) -> the family module that reads its config and builds
its layers. A new architecture is one module (read_config, decoder_layer) and one entry here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specserve.errors import SpecserveError
from specserve.model import llama, qwen2, qwen2moe, qwen3, qwen3moe
from specserve.model.blocks import DecoderLayer, RopeTables
from specserve.model.config import ModelConfig
from specserve.model.weights import LayerWeights


@dataclass(frozen=True)
class Family:
    read_config: Callable[[dict[str, Any], set[str]], ModelConfig]  # GGUF metadata, tensor names -> config
    decoder_layer: Callable[[ModelConfig, int, LayerWeights, RopeTables], DecoderLayer]


FAMILIES: dict[str, Family] = {
    "llama": Family(llama.read_config, llama.decoder_layer),
    "qwen2": Family(qwen2.read_config, qwen2.decoder_layer),
    "qwen3": Family(qwen3.read_config, qwen3.decoder_layer),
    "qwen2moe": Family(qwen2moe.read_config, qwen2moe.decoder_layer),
    "qwen3moe": Family(qwen3moe.read_config, qwen3moe.decoder_layer),
}


def family(arch: str | None) -> Family:
    if arch not in FAMILIES:
        raise SpecserveError(f"unsupported model architecture '{arch}' (supported: {', '.join(FAMILIES)})")
    return FAMILIES[arch]


def read_config(metadata: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    """The config of a GGUF file's model, as its architecture's family reads it."""
    return family(metadata.get("general.architecture")).read_config(metadata, tensor_names)
