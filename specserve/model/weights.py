"""Load a GGUF model's tensors into the layout the transformer runs on.

Q, K and V are fused into one matrix (and gate/up into another) so each block runs two
matmuls fewer per step: at small batch the GPU pays per kernel, not per byte.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm import tqdm

from specserve.gguf.reader import GGUFFile
from specserve.model.config import ModelConfig


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    wqkv: torch.Tensor  # [q + 2 kv, hidden]
    bqkv: torch.Tensor | None  # [q + 2 kv] (qwen2)
    q_norm: torch.Tensor | None  # [head_dim] (qwen3)
    k_norm: torch.Tensor | None
    wo: torch.Tensor  # [hidden, q]
    ffn_norm: torch.Tensor
    w_gate_up: torch.Tensor  # [2 ffn, hidden]
    w_down: torch.Tensor  # [hidden, ffn]


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    out_norm: torch.Tensor
    output: torch.Tensor  # [vocab, hidden]; the embedding itself when tied

    def n_bytes(self) -> int:
        """Bytes of all weight tensors (the output matrix once, even when tied)."""
        seen: set[int] = set()
        total = 0
        tensors = [self.embed, self.out_norm, self.output]
        for layer in self.layers:
            tensors += [t for t in vars(layer).values() if t is not None]
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total


def load_weights(gguf: GGUFFile, config: ModelConfig, dtype: torch.dtype,
                 device: torch.device | str, progress: bool = True) -> ModelWeights:
    n_tensors = len(gguf.tensor_names())
    bar = tqdm(total=n_tensors, desc="load", unit="tensor", disable=not progress, leave=False)

    def get(name: str, dt: torch.dtype = dtype) -> torch.Tensor:
        t = gguf.load_tensor(name, dt, device)
        bar.update(1)
        return t

    def maybe(name: str, dt: torch.dtype = dtype) -> torch.Tensor | None:
        return get(name, dt) if gguf.has_tensor(name) else None

    embed = get("token_embd.weight")
    layers = []
    for i in range(config.n_layers):
        p = f"blk.{i}."
        wqkv = torch.cat([get(p + "attn_q.weight"), get(p + "attn_k.weight"), get(p + "attn_v.weight")])
        bqkv = None
        if config.qkv_bias:
            bqkv = torch.cat([get(p + "attn_q.bias"), get(p + "attn_k.bias"), get(p + "attn_v.bias")])
        layers.append(
            LayerWeights(
                attn_norm=get(p + "attn_norm.weight"),
                wqkv=wqkv,
                bqkv=bqkv,
                q_norm=maybe(p + "attn_q_norm.weight"),
                k_norm=maybe(p + "attn_k_norm.weight"),
                wo=get(p + "attn_output.weight"),
                ffn_norm=get(p + "ffn_norm.weight"),
                w_gate_up=torch.cat([get(p + "ffn_gate.weight"), get(p + "ffn_up.weight")]),
                w_down=get(p + "ffn_down.weight"),
            )
        )
    out_norm = get("output_norm.weight")
    output = embed if config.tied_embeddings else get("output.weight")
    bar.close()
    return ModelWeights(embed=embed, layers=layers, out_norm=out_norm, output=output)
