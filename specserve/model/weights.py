"""Load a GGUF model's tensors into the layout the transformer runs on.

Q, K and V are fused into one matrix (and gate/up into another) so each block runs two
matmuls fewer per step: at small batch the GPU pays per kernel, not per byte.
"""

from __future__ import annotations

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


def load_weights(gguf: GGUFFile, config: ModelConfig, dtype: torch.dtype,
                 device: torch.device | str, progress: bool = True, weight_format: str = "bf16") -> ModelWeights:
    """weight_format "q8" quantizes each matrix from its fp32 dequantization (a Q8_0 file round-trips exactly)."""
    if weight_format not in WEIGHT_FORMATS:
        raise SpecserveError(f"unknown weight format '{weight_format}' (choose from {', '.join(WEIGHT_FORMATS)})")
    n_tensors = len(gguf.tensor_names())
    bar = tqdm(total=n_tensors, desc="load", unit="tensor", disable=not progress, leave=False)

    def get(name: str, dt: torch.dtype = dtype) -> torch.Tensor:
        t = gguf.load_tensor(name, dt, device)
        bar.update(1)
        return t

    def maybe(name: str, dt: torch.dtype = dtype) -> torch.Tensor | None:
        return get(name, dt) if gguf.has_tensor(name) else None

    def matrix(*names: str, quantize: bool = False) -> Weight:
        if weight_format == "q8" and quantize:
            return quantize_q8(torch.cat([get(n, torch.float32) for n in names]))
        return torch.cat([get(n) for n in names]) if len(names) > 1 else get(names[0])

    embed = get("token_embd.weight")
    layers = []
    for i in range(config.n_layers):
        p = f"blk.{i}."
        wqkv = matrix(p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight")
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
                wo=matrix(p + "attn_output.weight"),
                ffn_norm=get(p + "ffn_norm.weight"),
                w_gate_up=matrix(p + "ffn_gate.weight", p + "ffn_up.weight", quantize="w_gate_up" in Q8_MATRICES),
                w_down=matrix(p + "ffn_down.weight"),
            )
        )
    out_norm = get("output_norm.weight")
    if weight_format == "q8":
        output = quantize_q8(embed) if config.tied_embeddings else matrix("output.weight", quantize=True)
    else:
        output = embed if config.tied_embeddings else get("output.weight")
    bar.close()
    return ModelWeights(embed=embed, layers=layers, out_norm=out_norm, output=output)
