"""qwen2moe: Qwen1.5-MoE / Qwen2-MoE.

Qwen2's attention (neox RoPE, q/k/v biases); each feed-forward is a mixture of experts: softmax over the
router's logits, the top k weights used as they are (llama.cpp does not renormalise them for this
architecture), plus a shared expert that every token runs, scaled by sigmoid(x . ffn_gate_inp_shexp)."""

from __future__ import annotations

from typing import Any

from specserve.model import moe
from specserve.model.moe import MoeConfig


def read_config(metadata: dict[str, Any], tensor_names: set[str]) -> MoeConfig:
    return moe.read_moe_config(metadata, tensor_names, rope_style="neox", weights_norm=False)


decoder_layer = moe.decoder_layer
