"""Load a GGUF model's tensors into the layout the transformer runs on.

Q, K and V are fused into one matrix (and gate/up into another) so each block runs two
matmuls fewer per step: at small batch the GPU pays per kernel, not per byte.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
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


def _tensor_names(gguf: GGUFFile, config: ModelConfig) -> list[str]:
    names = ["token_embd.weight", "output_norm.weight"]
    if not config.tied_embeddings:
        names.append("output.weight")
    per_layer = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                 "ffn_down"]
    for i in range(config.n_layers):
        names += [f"blk.{i}.{n}.weight" for n in per_layer]
        if config.qkv_bias:
            names += [f"blk.{i}.attn_{x}.bias" for x in "qkv"]
        if config.qk_norm:
            names += [f"blk.{i}.attn_q_norm.weight", f"blk.{i}.attn_k_norm.weight"]
    return names


def load_weights(gguf: GGUFFile, config: ModelConfig, dtype: torch.dtype,
                 device: torch.device | str, progress: bool = True) -> ModelWeights:
    names = _tensor_names(gguf, config)
    for name in names:
        gguf.tensor_shape(name)  # a missing tensor fails here, before any work
    # Dequantization runs in numpy, which releases the GIL: threads load tensors in parallel.
    workers = min(8, os.cpu_count() or 1)
    with tqdm(total=len(names), desc="load", unit="tensor", disable=not progress, leave=False) as bar, \
            ThreadPoolExecutor(workers) as pool:
        def load(name: str) -> torch.Tensor:
            t = gguf.load_tensor(name, dtype, device)
            bar.update(1)
            return t

        t = dict(zip(names, pool.map(load, names), strict=True))

    def opt(name: str) -> torch.Tensor | None:
        return t.get(name)

    layers = []
    for i in range(config.n_layers):
        p = f"blk.{i}."
        bqkv = None
        if config.qkv_bias:
            bqkv = torch.cat([t[p + "attn_q.bias"], t[p + "attn_k.bias"], t[p + "attn_v.bias"]])
        layers.append(
            LayerWeights(
                attn_norm=t[p + "attn_norm.weight"],
                wqkv=torch.cat([t[p + "attn_q.weight"], t[p + "attn_k.weight"], t[p + "attn_v.weight"]]),
                bqkv=bqkv,
                q_norm=opt(p + "attn_q_norm.weight"),
                k_norm=opt(p + "attn_k_norm.weight"),
                wo=t[p + "attn_output.weight"],
                ffn_norm=t[p + "ffn_norm.weight"],
                w_gate_up=torch.cat([t[p + "ffn_gate.weight"], t[p + "ffn_up.weight"]]),
                w_down=t[p + "ffn_down.weight"],
            )
        )
        for suffix in ("attn_q.weight", "attn_k.weight", "attn_v.weight", "ffn_gate.weight", "ffn_up.weight"):
            del t[p + suffix]  # the fused copies replace them; free the parts now
    embed = t["token_embd.weight"]
    output = embed if config.tied_embeddings else t["output.weight"]
    return ModelWeights(embed=embed, layers=layers, out_norm=t["output_norm.weight"], output=output)
