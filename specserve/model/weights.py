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

from specserve.errors import SpecserveError
from specserve.gguf.reader import GGUFFile
from specserve.kernels.linear import Q8Weight, Weight, quantize_q8
from specserve.model.config import ModelConfig

WEIGHT_FORMATS = ("bf16", "q8")  # "bf16": matrices in the runner's dtype; "q8": int8 + fp16 scales
# Matrices that "q8" quantizes: those with many output rows, where the fused kernel beat
# cuBLAS bf16 on an H200 (gate_up 15.7 vs 18.7 us, output 88 vs 118 us). The others (few
# output rows, so few programs per step) stay bf16 until a split-K kernel makes int8 pay.
Q8_MATRICES = ("w_gate_up",)


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    wqkv: Weight  # [q + 2 kv, hidden]
    bqkv: torch.Tensor | None  # [q + 2 kv] (qwen2)
    q_norm: torch.Tensor | None  # [head_dim] (qwen3)
    k_norm: torch.Tensor | None
    wo: Weight  # [hidden, q]
    ffn_norm: torch.Tensor
    w_gate_up: Weight  # [2 ffn, hidden]
    w_down: Weight  # [hidden, ffn]


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    out_norm: torch.Tensor
    output: Weight  # [vocab, hidden]; the embedding itself when tied (unless quantized)

    def n_bytes(self) -> int:
        """Bytes of all weight tensors (the output matrix once, even when tied)."""
        seen: set[int] = set()
        total = 0
        tensors = [self.embed, self.out_norm, self.output]
        for layer in self.layers:
            tensors += [t for t in vars(layer).values() if t is not None]
        for t in tensors:
            key = t.q.data_ptr() if isinstance(t, Q8Weight) else t.data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.n_bytes() if isinstance(t, Q8Weight) else t.numel() * t.element_size()
        return total


def quantize_weights(weights: ModelWeights, weight_format: str) -> ModelWeights:
    """Weights with the Q8_MATRICES of every layer and the output matrix in `weight_format`, in place.

    The embedding stays a float table: one row of it is read per token.
    """
    if weight_format not in WEIGHT_FORMATS:
        raise SpecserveError(f"unknown weight format '{weight_format}' (choose from {', '.join(WEIGHT_FORMATS)})")
    if weight_format == "bf16":
        return weights
    for layer in weights.layers:
        for name in Q8_MATRICES:
            w = getattr(layer, name)
            if not isinstance(w, Q8Weight):
                setattr(layer, name, quantize_q8(w))
    if not isinstance(weights.output, Q8Weight):
        weights.output = quantize_q8(weights.output)
    return weights


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
                 device: torch.device | str, progress: bool = True, weight_format: str = "bf16") -> ModelWeights:
    """weight_format "q8" quantizes the Q8_MATRICES and the output matrix from fp32 dequantized
    values (a Q8_0 file round-trips exactly); everything else is in `dtype`."""
    if weight_format not in WEIGHT_FORMATS:
        raise SpecserveError(f"unknown weight format '{weight_format}' (choose from {', '.join(WEIGHT_FORMATS)})")
    names = _tensor_names(gguf, config)
    fp32_sources = set()
    if weight_format == "q8":
        fp32_sources = {n for n in names if n.endswith(("ffn_gate.weight", "ffn_up.weight", "output.weight"))}
    for name in names:
        gguf.tensor_shape(name)  # a missing tensor fails here, before any work
    # Dequantization runs in numpy, which releases the GIL: threads load tensors in parallel.
    workers = min(8, os.cpu_count() or 1)
    with tqdm(total=len(names), desc="load", unit="tensor", disable=not progress, leave=False) as bar, \
            ThreadPoolExecutor(workers) as pool:
        def load(name: str) -> torch.Tensor:
            t = gguf.load_tensor(name, torch.float32 if name in fp32_sources else dtype, device)
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
    weights = ModelWeights(embed=embed, layers=layers, out_norm=t["output_norm.weight"], output=output)
    return quantize_weights(weights, weight_format)
