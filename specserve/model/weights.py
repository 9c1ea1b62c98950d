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
from specserve.kernels.linear import QuantWeight, Weight, concat_quant, dequantize_ref, quantize_q8
from specserve.model.config import ModelConfig

# "float": every matrix in the runner's dtype (the default, "auto"). "gguf": block-quantized
# matrices stay quantized as in the file (4- or 8-bit integers, fp16 scale and min per group of
# 16 / 32; see QuantWeight and specserve.gguf.repack): a Q4_K_M file reads ~0.4 of bf16's bytes
# per token. "q8": every matrix quantized with Q8_0's rule from its float values (for float
# files and random weights).
WEIGHT_FORMATS = ("auto", "float", "gguf", "q8")
MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")


def resolve_weight_format(weight_format: str) -> str:
    if weight_format not in WEIGHT_FORMATS:
        raise SpecserveError(f"unknown weight format '{weight_format}' (choose from {', '.join(WEIGHT_FORMATS)})")
    return "float" if weight_format == "auto" else weight_format


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
            key = t.words.data_ptr() if isinstance(t, QuantWeight) else t.data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.n_bytes() if isinstance(t, QuantWeight) else t.numel() * t.element_size()
        return total


def quantize_weights(weights: ModelWeights, weight_format: str) -> ModelWeights:
    """With "q8", every float matrix of every layer and the output matrix quantized, in place.

    The embedding stays a float table: one row of it is read per token.
    """
    if resolve_weight_format(weight_format) != "q8":
        return weights
    for layer in weights.layers:
        for name in MATRICES:
            w = getattr(layer, name)
            if not isinstance(w, QuantWeight):
                setattr(layer, name, quantize_q8(w))
    if not isinstance(weights.output, QuantWeight):
        weights.output = quantize_q8(weights.output)
    return weights


def _fuse(parts: list[Weight], dtype: torch.dtype) -> Weight:
    """Stack matrices along N, quantized if all parts are, else in `dtype`."""
    if all(isinstance(p, QuantWeight) for p in parts):
        return concat_quant(parts)  # type: ignore[arg-type]
    return torch.cat([dequantize_ref(p, dtype) if isinstance(p, QuantWeight) else p for p in parts])


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


MATRIX_SUFFIXES = (".attn_q.weight", ".attn_k.weight", ".attn_v.weight", ".attn_output.weight", ".ffn_gate.weight",
                   ".ffn_up.weight", ".ffn_down.weight")


def _is_matrix(name: str) -> bool:
    return name == "output.weight" or name.endswith(MATRIX_SUFFIXES)


def _load_packed(gguf: GGUFFile, name: str, device: torch.device | str) -> QuantWeight | None:
    """A block-quantized matrix of the file packed for the quantized kernels; None for other types."""
    ints = gguf.load_quant(name, device)
    return None if ints is None else QuantWeight.from_ints(ints.q, ints.scale, ints.mins, ints.group)


def load_weights(gguf: GGUFFile, config: ModelConfig, dtype: torch.dtype,
                 device: torch.device | str, progress: bool = True, weight_format: str = "float") -> ModelWeights:
    """Tensors in `dtype`, the matrices in `weight_format` (see WEIGHT_FORMATS)."""
    weight_format = resolve_weight_format(weight_format)
    names = _tensor_names(gguf, config)
    tied_output = config.tied_embeddings and weight_format == "gguf"
    for name in names:
        gguf.tensor_shape(name)  # a missing tensor fails here, before any work
    # Dequantization runs in numpy, which releases the GIL: threads load tensors in parallel.
    workers = min(8, os.cpu_count() or 1)
    with tqdm(total=len(names) + tied_output, desc="load", unit="tensor", disable=not progress,
              leave=False) as bar, ThreadPoolExecutor(workers) as pool:
        def load(name: str) -> Weight:
            quant = _load_packed(gguf, name, device) if weight_format == "gguf" and _is_matrix(name) else None
            if quant is None:
                fp32 = weight_format == "q8" and _is_matrix(name)  # quantized from exact values below
                quant = gguf.load_tensor(name, torch.float32 if fp32 else dtype, device)
            bar.update(1)
            return quant

        t = dict(zip(names, pool.map(load, names), strict=True))
        if tied_output:  # the embedding stays a float table for lookups; the output matrix can stay packed
            t["output.weight"] = _load_packed(gguf, "token_embd.weight", device) or t["token_embd.weight"]
            bar.update(1)

    def opt(name: str) -> Weight | None:
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
                wqkv=_fuse([t[p + "attn_q.weight"], t[p + "attn_k.weight"], t[p + "attn_v.weight"]], dtype),
                bqkv=bqkv,
                q_norm=opt(p + "attn_q_norm.weight"),
                k_norm=opt(p + "attn_k_norm.weight"),
                wo=t[p + "attn_output.weight"],
                ffn_norm=t[p + "ffn_norm.weight"],
                w_gate_up=_fuse([t[p + "ffn_gate.weight"], t[p + "ffn_up.weight"]], dtype),
                w_down=t[p + "ffn_down.weight"],
            )
        )
        for suffix in ("attn_q.weight", "attn_k.weight", "attn_v.weight", "ffn_gate.weight", "ffn_up.weight"):
            del t[p + suffix]  # the fused copies replace them; free the parts now
    embed = t["token_embd.weight"]
    output = t.get("output.weight", embed)
    weights = ModelWeights(embed=embed, layers=layers, out_norm=t["output_norm.weight"], output=output)
    return quantize_weights(weights, weight_format)
