"""LoRA adapters from llama.cpp's GGUF adapter files, added to the model's products (kernels/low_rank.py).

An adapter file (general.type "adapter", adapter.type "lora", adapter.lora.alpha) holds, for some of the base
model's matrices W [out, in], a pair `<W's name>.lora_a` [r, in] and `.lora_b` [out, r]; with scale s a product
becomes x W^T + s * alpha / r * (x A^T) B^T (just s where alpha is 0), as llama.cpp computes it. Every loaded
adapter reaches the attention and feed-forward matrices of dense layers and the output head; each sequence
of the runner has its own scales (`AdapterScales`), so one step serves rows with different adapters.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.errors import SpecserveError
from specserve.gguf.reader import GGUFFile
from specserve.kernels.low_rank import LowRank
from specserve.kernels.step_ops import NormFeedForwardAdd
from specserve.model.config import ModelConfig
from specserve.model.transformer import Transformer

# A layer's matrix in the file -> the product it is part of, and its part ([q | k | v], [gate | up])
LAYER_PARTS = {"attn_q": ("qkv", 0), "attn_k": ("qkv", 1), "attn_v": ("qkv", 2), "attn_output": ("out", 0),
               "ffn_gate": ("gate_up", 0), "ffn_up": ("gate_up", 1), "ffn_down": ("down", 0)}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


@dataclass(frozen=True)
class Adapter:
    path: Path
    alpha: float
    architecture: str | None
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]  # base tensor name -> (A [r, in], B [out, r]), fp32


def check_adapter_files(paths: Iterable[str | Path]) -> None:
    """SpecserveError for an adapter file that is not there (before anything loads)."""
    for path in paths:
        if not Path(path).is_file():
            raise SpecserveError(f"LoRA adapter file not found: {path}")


def read_adapter(path: str | Path) -> Adapter:
    """One adapter file's pairs; SpecserveError for a file that is not a LoRA adapter or has a broken pair."""
    check_adapter_files([path])
    f = GGUFFile(path)
    meta = f.metadata
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise SpecserveError(f"{path} is not a LoRA adapter (its general.type is '{meta.get('general.type')}', "
                             f"adapter.type '{meta.get('adapter.type')}'; 'adapter' and 'lora' expected)")
    names = set(f.tensor_names())
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name in sorted(names):
        base, _, kind = name.rpartition(".")
        if kind not in ("lora_a", "lora_b"):
            raise SpecserveError(f"{path}: tensor {name} is neither a lora_a nor a lora_b")
        other = base + (".lora_b" if kind == "lora_a" else ".lora_a")
        if other not in names:
            raise SpecserveError(f"{path}: {name} has no {other.rpartition('.')[2]}")
        if kind == "lora_b":
            continue
        a, b = f.load_tensor(name), f.load_tensor(other)
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise SpecserveError(f"{path}: {base}'s lora_a {tuple(a.shape)} and lora_b {tuple(b.shape)} are not a "
                                 "pair of rank r ([r, in] and [out, r])")
        pairs[base] = (a, b)
    if not pairs:
        raise SpecserveError(f"{path}: the adapter has no tensors")
    return Adapter(Path(path), float(meta.get("adapter.lora.alpha", 0.0)), meta.get("general.architecture"), pairs)


@dataclass
class _Product:
    """One product the adapters reach: the op field its LowRank goes to, its input size and its parts' sizes."""

    op: object
    field: str
    n_in: int
    parts: tuple[int, ...]


def _products(model: Transformer, config: ModelConfig) -> dict[str, _Product]:
    kv = config.n_kv_heads * config.head_dim
    out: dict[str, _Product] = {}
    for i, layer in enumerate(model.layers):
        attention = layer.attention
        out[f"blk.{i}.qkv"] = _Product(attention.qkv, "adapters", config.hidden, (config.q_size, kv, kv))
        out[f"blk.{i}.out"] = _Product(attention.out, "adapters", config.q_size, (config.hidden,))
        ffn = getattr(layer.feed_forward, "ffn", None)
        if isinstance(ffn, NormFeedForwardAdd):
            n = ffn.w_gate_up.shape[0] // 2
            out[f"blk.{i}.gate_up"] = _Product(ffn, "gate_up_adapters", config.hidden, (n, n))
            out[f"blk.{i}.down"] = _Product(ffn, "down_adapters", n, (config.hidden,))
    out["output"] = _Product(model.head.head, "adapters", config.hidden, (config.vocab_size,))
    return out


def _place(base: str) -> tuple[str, int] | None:
    """The product and part a base tensor name belongs to (None: not one adapters reach)."""
    if base == "output.weight":
        return "output", 0
    m = _LAYER_TENSOR.fullmatch(base)
    if m is None or m.group(2) not in LAYER_PARTS:
        return None
    product, part = LAYER_PARTS[m.group(2)]
    return f"blk.{m.group(1)}.{product}", part


def _low_rank(product: _Product, pieces: list[tuple[int, int, float, torch.Tensor, torch.Tensor]],
              dtype: torch.dtype, device: torch.device) -> LowRank:
    """pieces: (adapter, part, factor, A, B) for one product -> its stacked LowRank."""
    rank = sum(a.shape[0] for _, _, _, a, _ in pieces)
    offsets = [sum(product.parts[:p]) for p in range(len(product.parts))]
    b_all = torch.zeros(sum(product.parts), rank)
    owner = torch.zeros(rank, dtype=torch.long)
    col = 0
    for adapter, part, factor, a, b in pieces:
        r = a.shape[0]
        b_all[offsets[part]:offsets[part] + b.shape[0], col:col + r] = factor * b
        owner[col:col + r] = adapter
        col += r
    a_all = torch.cat([a for _, _, _, a, _ in pieces])
    return LowRank(a_all.to(device, dtype), b_all.to(device, dtype), owner.to(device))


def attach_adapters(model: Transformer, config: ModelConfig, adapters: list[Adapter], n_seqs: int) -> AdapterScales:
    """Give the model's products every adapter's pairs (checked against the model's shapes), and the sequences
    a table of scales, all 0 until set."""
    products = _products(model, config)
    gathered: dict[str, list[tuple[int, int, float, torch.Tensor, torch.Tensor]]] = {}
    for j, adapter in enumerate(adapters):
        if adapter.architecture is not None and adapter.architecture != config.arch:
            raise SpecserveError(f"{adapter.path} adapts a '{adapter.architecture}' model, not this '{config.arch}'")
        for base, (a, b) in adapter.pairs.items():
            place = _place(base)
            if place is None or place[0] not in products:
                raise SpecserveError(f"{adapter.path} adapts {base}: adapters reach the attention and dense "
                                     "feed-forward matrices and the output head only")
            product = products[place[0]]
            if a.shape[1] != product.n_in or b.shape[0] != product.parts[place[1]]:
                raise SpecserveError(f"{adapter.path}: {base}'s pair ({tuple(a.shape)}, {tuple(b.shape)}) does not "
                                     f"fit the model's matrix [{product.parts[place[1]]}, {product.n_in}]")
            factor = adapter.alpha / a.shape[0] if adapter.alpha else 1.0
            gathered.setdefault(place[0], []).append((j, place[1], factor, a, b))
    weights = model.weights
    for key, pieces in gathered.items():
        product = products[key]
        setattr(product.op, product.field, _low_rank(product, pieces, weights.embed.dtype, weights.embed.device))
    scales = AdapterScales([a.path for a in adapters], n_seqs, weights.embed.device, weights.embed.dtype)
    model.use_adapters(scales)
    return scales


class AdapterScales:
    """Each sequence's scale per adapter (a row per sequence, and one more for a CUDA graph's padding rows,
    which stays 0); a step reads its rows' scales by sequence id. While no sequence has a scale (`in_use`
    false) steps skip the adapters' products, unless `always` (captured graphs must hold them)."""

    def __init__(self, paths: list[Path], n_seqs: int, device: torch.device, dtype: torch.dtype):
        self.paths = paths
        self.table = torch.zeros(n_seqs + 1, len(paths), device=device, dtype=dtype)
        self._using: set[int] = set()
        self.always = False

    @property
    def in_use(self) -> bool:
        return self.always or bool(self._using)

    def set(self, seq: int, scales: tuple[float, ...]) -> None:
        """scales: one per adapter, or () for none. A copy in stream order: a step queued before it keeps the
        sequence's former scales."""
        if scales and len(scales) != len(self.paths):
            raise SpecserveError(f"{len(scales)} adapter scales for {len(self.paths)} adapters")
        self.table[seq] = torch.tensor(scales or [0.0] * len(self.paths), dtype=self.table.dtype)
        if any(scales):
            self._using.add(seq)
        else:
            self._using.discard(seq)
