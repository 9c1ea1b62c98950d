"""The model families: GGUF `general.architecture` -> how its config is read and its layers are built.

Every family here is a decoder of the same blocks (model/blocks.py, model/moe.py); what sets them apart is data,
so each is one entry of FAMILIES: its RoPE style, and its experts (none, where the file has them, or always) with
their routing. A family with layers of its own adds a module beside blocks.py whose builder the entry names.

- llama: Llama and models converted as it (SmolLM2, Mistral, Mixtral, ...). llama.cpp's converter permutes Q and K
  so that RoPE rotates adjacent pairs ("interleaved"); q/k/v biases are read where the file has them
  (config.decoder_fields). A file with stacked expert tensors (ffn_gate_exps: Mixtral) has mixture-of-experts
  layers: softmax over the router's logits, top k, the k weights divided by their sum.
- qwen2: Qwen2 / Qwen2.5 (and their coder models): neox RoPE (the two halves of each head), q/k/v biases.
- qwen3: Qwen3 (dense): neox RoPE, no biases, an RMSNorm over each q and k head before RoPE.
- qwen2moe: Qwen1.5-MoE / Qwen2-MoE: qwen2's attention; softmax routing whose top k weights are used as they
  are (llama.cpp does not renormalise them here), plus a shared expert scaled by sigmoid(x . ffn_gate_inp_shexp).
- qwen3moe: Qwen3 MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B): qwen3's attention; softmax
  routing, top k weights divided by their sum; no shared expert.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from specserve.errors import SpecserveError
from specserve.model import moe
from specserve.model.blocks import DecoderLayer, RopeTables
from specserve.model.config import ModelConfig, decoder_fields
from specserve.model.weights import LayerWeights, is_moe_layer


@dataclass(frozen=True)
class Family:
    rope_style: Literal["interleaved", "neox"]
    experts: Literal["never", "if_present", "always"] = "never"
    weights_norm: bool = True  # the experts' top k weights divided by their sum
    # Layers: dense, or a mixture of experts where the config has experts (moe.decoder_layer decides per config)
    decoder_layer: Callable[[ModelConfig, int, LayerWeights, RopeTables], DecoderLayer] = moe.decoder_layer

    def read_config(self, metadata: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
        if self.experts == "always" or (self.experts == "if_present" and is_moe_layer(tensor_names, 0)):
            return moe.read_moe_config(metadata, tensor_names, rope_style=self.rope_style,
                                       weights_norm=self.weights_norm)
        return ModelConfig(**decoder_fields(metadata, tensor_names), rope_style=self.rope_style)


FAMILIES: dict[str, Family] = {
    "llama": Family("interleaved", experts="if_present"),
    "qwen2": Family("neox"),
    "qwen3": Family("neox"),
    "qwen2moe": Family("neox", experts="always", weights_norm=False),
    "qwen3moe": Family("neox", experts="always"),
}


def family(arch: str | None) -> Family:
    if arch not in FAMILIES:
        raise SpecserveError(f"unsupported model architecture '{arch}' (supported: {', '.join(FAMILIES)})")
    return FAMILIES[arch]


def read_config(metadata: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    """The config of a GGUF file's model, as its architecture's family reads it."""
    return family(metadata.get("general.architecture")).read_config(metadata, tensor_names)
