"""qwen3moe: Qwen3 MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B).

Qwen3's attention (neox RoPE, per-head q/k RMSNorm, no biases); each feed-forward is a mixture of
experts: softmax over the router's logits, top k, the k weights divided by their sum (llama.cpp always
normalises them for this architecture); no shared expert."""

from __future__ import annotations

from typing import Any

from specserve.model import moe
from specserve.model.moe import MoeConfig


def read_config(metadata: dict[str, Any], tensor_names: set[str]) -> MoeConfig:
    return moe.read_moe_config(metadata, tensor_names, rope_style="neox", weights_norm=True)


decoder_layer = moe.decoder_layer
