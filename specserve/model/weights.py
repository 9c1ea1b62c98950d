"""Load a GGUF model's tensors into the layout the transformer runs on.

Q, K and V are fused into one matrix (and gate/up into another) so each block runs two
matmuls fewer per step: at small batch the GPU pays per kernel, not per byte.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Container
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from gguf.constants import MODEL_TENSOR, TENSOR_NAMES
from tqdm import tqdm

from specserve.errors import SpecserveError
from specserve.gguf.reader import GGUFFile
from specserve.kernels.backend import kernels_for
from specserve.kernels.quant_experts import ExpertMatrix, QuantExperts
from specserve.kernels.quant_weight import QuantWeight, Weight, concat_quant, dequantize_ref, quantize_q8
from specserve.kernels.torch_kernels import TorchKernels
from specserve.model.config import ModelConfig

log = logging.getLogger(__name__)

# "float": every matrix in the runner's dtype (the default, "auto"). "gguf": block-quantized
# matrices stay quantized as in the file (4- or 8-bit integers, fp16 scale and min per group of
# 16 / 32; see QuantWeight and specserve.gguf.repack): a Q4_K_M file reads ~0.4 of bf16's bytes
# per token. "q8": every matrix quantized with Q8_0's rule from its float values (for float
# files and random weights). A mixture of experts' stacked expert tensors are packed by either
# where the expert kernels run (CUDA), float elsewhere (see ExpertWeights).
WEIGHT_FORMATS = ("auto", "float", "gguf", "q8")
MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")


def resolve_weight_format(weight_format: str, device: torch.device | None = None) -> str:
    """"auto": the file's packed matrices on a CPU with the packed-weight kernel (decode reads 4-8 bits a weight
    instead of 32, same greedy text), float elsewhere (on CUDA bf16 verify steps are cheaper)."""
    if weight_format not in WEIGHT_FORMATS:
        raise SpecserveError(f"unknown weight format '{weight_format}' (choose from {', '.join(WEIGHT_FORMATS)})")
    if weight_format != "auto":
        return weight_format
    from specserve.kernels import quant_cpu

    return "gguf" if device is not None and device.type == "cpu" and quant_cpu.kernel_built() else "float"


def _moe_name(tensor: MODEL_TENSOR, layer: int) -> str:
    """llama.cpp's name of a layer's MoE tensor, from the gguf package's own table."""
    return TENSOR_NAMES[tensor].format(bid=layer) + ".weight"


MOE_TENSORS = {  # ExpertWeights' source tensors, by role
    "router": MODEL_TENSOR.FFN_GATE_INP, "gate": MODEL_TENSOR.FFN_GATE_EXP, "up": MODEL_TENSOR.FFN_UP_EXP,
    "down": MODEL_TENSOR.FFN_DOWN_EXP, "shared_gate": MODEL_TENSOR.FFN_GATE_INP_SHEXP,
    "shared_gate_proj": MODEL_TENSOR.FFN_GATE_SHEXP, "shared_up": MODEL_TENSOR.FFN_UP_SHEXP,
    "shared_down": MODEL_TENSOR.FFN_DOWN_SHEXP,
}
SHARED_MATRICES = ("shared_gate_proj", "shared_up", "shared_down")


def moe_tensor_name(role: str, layer: int) -> str:
    return _moe_name(MOE_TENSORS[role], layer)


def is_moe_layer(tensor_names: Container[str], layer: int) -> bool:
    """A layer is a mixture of experts when the file has its stacked expert tensors (ffn_gate_exps)."""
    return moe_tensor_name("gate", layer) in tensor_names


@dataclass
class ExpertWeights:
    """A mixture-of-experts feed-forward. With "gguf" or "q8", on a device where the packed-expert kernels
    run (the device's kernels' `experts_packed`: CUDA, a CPU with the packed-weight kernels), the stacked
    expert tensors are `QuantExperts` (the file's blocks, or Q8_0 of the float values); elsewhere, or when a
    file's expert type cannot be packed, they are float in the runner's dtype (logged). The shared expert's
    matrices take the weight format like dense ones."""

    router: torch.Tensor  # [n_expert, hidden] (ffn_gate_inp)
    gate_up: ExpertMatrix  # [n_expert, 2 ffn_expert, hidden]: ffn_gate_exps | ffn_up_exps along dim 1
    down: ExpertMatrix  # [n_expert, hidden, ffn_expert]
    shared_gate_up: Weight | None = None  # [2 ffn_shared, hidden] (qwen2moe)
    shared_down: Weight | None = None  # [hidden, ffn_shared]
    shared_gate: torch.Tensor | None = None  # [1, hidden] (ffn_gate_inp_shexp)

    def tensors(self) -> list[Weight | QuantExperts]:
        return [t for t in vars(self).values() if t is not None]


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    wqkv: Weight  # [q + 2 kv, hidden]
    bqkv: torch.Tensor | None  # [q + 2 kv] (qwen2)
    q_norm: torch.Tensor | None  # [head_dim] (qwen3)
    k_norm: torch.Tensor | None
    wo: Weight  # [hidden, q]
    ffn_norm: torch.Tensor
    w_gate_up: Weight | None  # [2 ffn, hidden]; None in a mixture-of-experts layer
    w_down: Weight | None  # [hidden, ffn]
    experts: ExpertWeights | None = None  # a mixture-of-experts layer's feed-forward


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
        tensors: list[Weight | QuantExperts] = [self.embed, self.out_norm, self.output]
        for layer in self.layers:
            tensors += [t for t in vars(layer).values() if t is not None and not isinstance(t, ExpertWeights)]
            tensors += layer.experts.tensors() if layer.experts is not None else []
        for t in tensors:
            packed = t.w if isinstance(t, QuantExperts) else t
            key = packed.words.data_ptr() if isinstance(packed, QuantWeight) else packed.data_ptr()
            if key not in seen:
                seen.add(key)
                total += packed.n_bytes() if isinstance(packed, QuantWeight) else packed.numel() * packed.element_size()
        return total


def quantize_weights(weights: ModelWeights, weight_format: str) -> ModelWeights:
    """With "q8", every float matrix of every layer and the output matrix quantized, in place.

    The embedding stays a float table: one row of it is read per token. Stacked expert tensors are
    quantized where packed experts run (ExpertWeights), and a shared expert's matrices always.
    """
    if resolve_weight_format(weight_format) != "q8":
        return weights
    pack_experts = kernels_for(weights.embed.device).experts_packed
    for layer in weights.layers:
        experts = layer.experts
        if experts is not None and pack_experts:
            for name in ("gate_up", "down"):
                w = getattr(experts, name)
                if isinstance(w, torch.Tensor):
                    setattr(experts, name, QuantExperts.quantize_q8(w))
        holders = [(layer, MATRICES)] + ([(layer.experts, ("shared_gate_up", "shared_down"))] if layer.experts else [])
        for holder, names in holders:
            for name in names:
                w = getattr(holder, name)
                if w is not None and not isinstance(w, QuantWeight):
                    setattr(holder, name, quantize_q8(w))
    if not isinstance(weights.output, QuantWeight):
        weights.output = quantize_q8(weights.output)
    return weights


def add_dense_copies(weights: ModelWeights, dtype: torch.dtype, budget: int, kernels: TorchKernels) -> int:
    """Give each packed matrix of the dense layers and the output head its dequantized copy in `dtype`
    (QuantWeight.dense: steps of many rows run on cuBLAS over it), if all of them fit in `budget` bytes.
    Stacked experts get none; kernels: the runner's, which dequantize. Returns the bytes added (0: none)."""
    found = [getattr(layer, name) for layer in weights.layers for name in MATRICES] + [weights.output]
    packed = list({id(w): w for w in found if isinstance(w, QuantWeight)}.values())
    need = sum(w.shape.numel() for w in packed) * torch.empty((), dtype=dtype).element_size()
    if not packed or need > budget:
        return 0
    for w in packed:
        w.dense = kernels.dequantize(w, dtype)
    return need


def fuse_matrices(parts: list[Weight], dtype: torch.dtype) -> Weight:
    """Stack matrices along N, quantized if all parts are, else in `dtype`."""
    packed = [p for p in parts if isinstance(p, QuantWeight)]
    if len(packed) == len(parts):
        return concat_quant(packed)
    return torch.cat([dequantize_ref(p, dtype) if isinstance(p, QuantWeight) else p for p in parts])


Loaded = Weight | QuantExperts  # a tensor as load_weights reads it


def _tensor(w: Loaded | None) -> torch.Tensor:
    """A tensor never packed: a norm, a bias, the embedding table, a router."""
    assert isinstance(w, torch.Tensor)
    return w


def _matrix(w: Loaded | None) -> Weight:
    """A layer's (or the output head's) matrix: packed or float."""
    assert w is not None and not isinstance(w, QuantExperts)
    return w


def _expert_stack(w: Loaded | None) -> ExpertMatrix:
    """A stack of experts [n_expert, N, K]: packed or float."""
    assert isinstance(w, torch.Tensor | QuantExperts)
    return w


def _tensor_names(gguf: GGUFFile, config: ModelConfig) -> list[str]:
    names = ["token_embd.weight", "output_norm.weight"]
    if not config.tied_embeddings:
        names.append("output.weight")
    per_layer = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm"]
    in_file = set(gguf.tensor_names())
    for i in range(config.n_layers):
        names += [f"blk.{i}.{n}.weight" for n in per_layer]
        if is_moe_layer(in_file, i):
            roles = ["router", "gate", "up", "down"]
            if moe_tensor_name("shared_gate_proj", i) in in_file:
                roles += list(SHARED_MATRICES)
            if moe_tensor_name("shared_gate", i) in in_file:
                roles.append("shared_gate")
            names += [moe_tensor_name(role, i) for role in roles]
        else:
            names += [f"blk.{i}.{n}.weight" for n in ("ffn_gate", "ffn_up", "ffn_down")]
        if config.qkv_bias:
            names += [f"blk.{i}.attn_{x}.bias" for x in "qkv"]
        if config.qk_norm:
            names += [f"blk.{i}.attn_q_norm.weight", f"blk.{i}.attn_k_norm.weight"]
    return names


MATRIX_SUFFIXES = (".attn_q.weight", ".attn_k.weight", ".attn_v.weight", ".attn_output.weight", ".ffn_gate.weight",
                   ".ffn_up.weight", ".ffn_down.weight", ".ffn_gate_shexp.weight", ".ffn_up_shexp.weight",
                   ".ffn_down_shexp.weight")


EXPERT_SUFFIXES = tuple(TENSOR_NAMES[t].removeprefix("blk.{bid}") + ".weight"
                        for t in (MODEL_TENSOR.FFN_GATE_EXP, MODEL_TENSOR.FFN_UP_EXP, MODEL_TENSOR.FFN_DOWN_EXP))


def _is_matrix(name: str) -> bool:
    return name == "output.weight" or name.endswith(MATRIX_SUFFIXES)


def _is_experts(name: str) -> bool:
    return name.endswith(EXPERT_SUFFIXES)


def load_packed(gguf: GGUFFile, name: str, device: torch.device | str) -> QuantWeight | None:
    """A block-quantized matrix of the file packed for the quantized kernels; None for other types."""
    ints = gguf.load_quant(name, device)
    return None if ints is None else QuantWeight.from_ints(ints.q, ints.scale, ints.mins, ints.group)


def _load_packed_experts(gguf: GGUFFile, name: str, device: torch.device | str) -> QuantExperts | None:
    """A block-quantized stack of experts [n_expert, N, K] packed as one QuantWeight; None for other types."""
    ints = gguf.load_quant(name, device)
    if ints is None:
        return None
    return QuantExperts(QuantWeight.from_ints(ints.q, ints.scale, ints.mins, ints.group), gguf.tensor_shape(name)[0])


def _experts_as_loaded(gate: ExpertMatrix, up: ExpertMatrix, down: ExpertMatrix,
                       dtype: torch.dtype) -> tuple[ExpertMatrix, ExpertMatrix]:
    """(gate_up, down): packed where all three are, else all float (a file mixing packable and other types
    for one layer's experts is rare; the kernels take one kind)."""
    if isinstance(gate, QuantExperts) and isinstance(up, QuantExperts) and isinstance(down, QuantExperts):
        return QuantExperts.concat([gate, up]), down

    def as_float(w: ExpertMatrix) -> torch.Tensor:
        return dequantize_ref(w.w, dtype).view(w.shape) if isinstance(w, QuantExperts) else w

    return torch.cat([as_float(gate), as_float(up)], dim=1), as_float(down)


def _expert_weights(t: dict[str, Loaded], layer: int, config: ModelConfig, dtype: torch.dtype) -> ExpertWeights:
    """Layer `layer`'s MoE tensors out of the loaded ones `t` (gate and up fused along dim 1, like the
    dense [gate | up]); the parts are removed from `t` as they are fused."""

    def take(role: str) -> Loaded | None:
        return t.pop(moe_tensor_name(role, layer), None)

    gate, up, down = (_expert_stack(take(role)) for role in ("gate", "up", "down"))
    n_expert, ffn, hidden = gate.shape
    if up.shape != gate.shape or down.shape != (n_expert, hidden, ffn) or hidden != config.hidden:
        raise SpecserveError(f"layer {layer}: expert tensors of shapes {tuple(gate.shape)}, {tuple(up.shape)}, "
                             f"{tuple(down.shape)} do not fit a hidden size of {config.hidden}")
    router = _tensor(take("router"))
    if router.shape != (n_expert, hidden):
        raise SpecserveError(f"layer {layer}: router of shape {tuple(router.shape)} for {n_expert} experts")
    shared_gate_up = None
    if moe_tensor_name("shared_gate_proj", layer) in t:
        shared_gate_up = fuse_matrices([_matrix(take("shared_gate_proj")), _matrix(take("shared_up"))], dtype)
    shared_gate, shared_down = take("shared_gate"), take("shared_down")
    gate_up, down = _experts_as_loaded(gate, up, down, dtype)
    return ExpertWeights(router=router, gate_up=gate_up, down=down, shared_gate_up=shared_gate_up,
                         shared_down=None if shared_down is None else _matrix(shared_down),
                         shared_gate=None if shared_gate is None else _tensor(shared_gate).reshape(1, hidden))


def load_weights(gguf: GGUFFile, config: ModelConfig, dtype: torch.dtype,
                 device: torch.device | str, progress: bool = True, weight_format: str = "float") -> ModelWeights:
    """Tensors in `dtype`, the matrices in `weight_format` (see WEIGHT_FORMATS)."""
    weight_format = resolve_weight_format(weight_format)
    names = _tensor_names(gguf, config)
    pack_experts = weight_format != "float" and kernels_for(device).experts_packed
    tied_output = config.tied_embeddings and weight_format == "gguf"
    for name in names:
        gguf.tensor_shape(name)  # a missing tensor fails here, before any work
    # Dequantization runs in numpy, which releases the GIL: threads load tensors in parallel.
    workers = min(8, os.cpu_count() or 1)
    with tqdm(total=len(names) + tied_output, desc="load", unit="tensor", disable=not progress,
              leave=False) as bar, ThreadPoolExecutor(workers) as pool:
        def load(name: str) -> Loaded:
            quant: Loaded | None = None
            if weight_format == "gguf" and _is_matrix(name):
                quant = load_packed(gguf, name, device)
            elif weight_format == "gguf" and pack_experts and _is_experts(name):
                quant = _load_packed_experts(gguf, name, device)
            if quant is None:
                # quantized from exact values below
                fp32 = weight_format == "q8" and (_is_matrix(name) or (pack_experts and _is_experts(name)))
                quant = gguf.load_tensor(name, torch.float32 if fp32 else dtype, device)
            bar.update(1)
            return quant

        t = dict(zip(names, pool.map(load, names), strict=True))
        if tied_output:  # the embedding stays a float table for lookups; the output matrix can stay packed
            t["output.weight"] = load_packed(gguf, "token_embd.weight", device) or t["token_embd.weight"]
            bar.update(1)
    n_float = sum(_is_experts(name) and isinstance(t[name], torch.Tensor) for name in names)
    if n_float and weight_format != "float" and not (pack_experts and weight_format == "q8"):  # q8: packed below
        why = ("of types that cannot be packed" if pack_experts
               else f"no packed-expert kernels run on {device}")
        log.warning("%d of the stacked expert tensors load as float (%s): %s", n_float, dtype, why)

    def opt(name: str) -> torch.Tensor | None:
        return _tensor(t[name]) if name in t else None

    layers = []
    for i in range(config.n_layers):
        p = f"blk.{i}."
        bqkv = None
        if config.qkv_bias:
            bqkv = torch.cat([_tensor(t[p + "attn_q.bias"]), _tensor(t[p + "attn_k.bias"]),
                              _tensor(t[p + "attn_v.bias"])])
        dense = not is_moe_layer(t, i)
        layers.append(
            LayerWeights(
                attn_norm=_tensor(t[p + "attn_norm.weight"]),
                wqkv=fuse_matrices([_matrix(t[p + f"attn_{x}.weight"]) for x in "qkv"], dtype),
                bqkv=bqkv,
                q_norm=opt(p + "attn_q_norm.weight"),
                k_norm=opt(p + "attn_k_norm.weight"),
                wo=_matrix(t[p + "attn_output.weight"]),
                ffn_norm=_tensor(t[p + "ffn_norm.weight"]),
                w_gate_up=fuse_matrices([_matrix(t.pop(p + "ffn_gate.weight")), _matrix(t.pop(p + "ffn_up.weight"))],
                                dtype) if dense else None,
                w_down=_matrix(t[p + "ffn_down.weight"]) if dense else None,
                experts=None if dense else _expert_weights(t, i, config, dtype),
            )
        )
        for suffix in ("attn_q.weight", "attn_k.weight", "attn_v.weight"):
            del t[p + suffix]  # the fused copies replace them; free the parts now
    embed = _tensor(t["token_embd.weight"])
    output = _matrix(t.get("output.weight", embed))
    weights = ModelWeights(embed=embed, layers=layers, out_norm=_tensor(t["output_norm.weight"]), output=output)
    return quantize_weights(weights, weight_format)
