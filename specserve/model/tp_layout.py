"""Tensor parallelism's cut of a model (Megatron-style), and loading one rank's cut from a GGUF file.

Each of `world` ranks holds:

- attention: a contiguous range of query heads, as even as the count allows (the first n_heads % world
  ranks one more), their rows of the Q product and bias, and their columns of the output product;
- the KV heads its query heads read (see below) as rows of the K and V products;
- the feed-forward: a contiguous range of the ffn units, their rows of gate and up (column-parallel) and
  their columns of down (row-parallel);
- the vocabulary: ceil(vocab / world) rows of the embedding and of the output matrix (the last rank's padded
  with zero rows), so every rank's logits are equally wide and gather into one tensor.

The KV-head rule. Query head h reads KV head h // group (group = n_heads / n_kv_heads), and the attention
kernels assume the same rule on each rank's local heads. A rank's query heads fall into runs of equal KV
head; with g the gcd of the run lengths, the rank keeps run_length / g copies of each run's KV head, so its
local query head j reads local KV head j // g. When the KV heads divide evenly over the ranks (n_kv_heads %
world == 0, the common case) every run is a whole group: no copies, each rank its own KV heads. When the
ranks divide a group evenly (world % n_kv_heads == 0 and group % (world / n_kv_heads) == 0), each rank keeps
one KV head, replicated on the ranks that share its group (as vLLM does). Otherwise some rank holds KV heads
more than once (qwen2.5-coder-0.5b, 14 query / 2 KV heads at 4 ranks: query heads 4, 4, 3, 3; the second
rank's run lengths 3 and 1 give it 4 local KV heads, the others 1 each), which costs that rank KV-cache
memory and K/V product rows but keeps the query heads, the work that grows with the context, balanced.
Copies compute the same K and V, so the attention of every query head is what one process computes.

Only dense layers are cut (experts, expert parallelism, are not here yet). Matrices load in the weight format asked
for: with "gguf" the file's blocks stay packed where a rank's cut falls on whole groups (rows always do; a
row-parallel matrix's columns where its heads' or ffn units' range is a multiple of the group), else float.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from itertools import groupby

import torch
from tqdm import tqdm

from specserve.errors import SpecserveError
from specserve.gguf.reader import GGUFFile
from specserve.kernels.quant_weight import QuantWeight, Weight
from specserve.model.config import ModelConfig
from specserve.model.moe import MoeConfig
from specserve.model.weights import (
    LayerWeights,
    ModelWeights,
    fuse_matrices,
    is_moe_layer,
    load_packed,
    quantize_weights,
)


def even_split(n: int, world: int, rank: int) -> range:
    """Rank's part of range(n) cut into `world` contiguous parts, the first n % world one longer."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def check_tensor_parallel(config: ModelConfig, world: int, tensor_names: set[str] | None = None) -> None:
    """SpecserveError unless `world` ranks can split this model (before any process is started)."""
    if world < 1:
        raise SpecserveError(f"--tensor-parallel must be at least 1, got {world}")
    if isinstance(config, MoeConfig) or (tensor_names is not None and any(
            is_moe_layer(tensor_names, i) for i in range(config.n_layers))):
        raise SpecserveError("--tensor-parallel: mixture-of-experts models are not supported yet (dense only)")
    if config.n_heads % config.n_kv_heads:
        raise SpecserveError(f"{config.n_heads} query heads over {config.n_kv_heads} KV heads")
    if world > config.n_heads or world > config.ffn:
        raise SpecserveError(f"--tensor-parallel {world}: this model has {config.n_heads} query heads, so at most "
                             f"{min(config.n_heads, config.ffn)} ranks (1..{config.n_heads} are valid)")


@dataclass(frozen=True)
class ShardLayout:
    """What rank `rank` of `world` holds of a model of `config` (the module docstring's rule)."""

    config: ModelConfig  # the whole model's
    rank: int
    world: int
    q_heads: range  # global query heads
    kv_heads: tuple[int, ...]  # the global KV head of each local KV head (repeats: copies)
    ffn: range  # global ffn units
    vocab: range  # token ids whose embedding and output rows this rank holds
    vocab_rows: int  # rows every rank holds, ceil(vocab / world): the last rank's are padded

    @classmethod
    def plan(cls, config: ModelConfig, rank: int, world: int) -> ShardLayout:
        check_tensor_parallel(config, world)
        if not 0 <= rank < world:
            raise SpecserveError(f"rank {rank} out of range for {world} ranks")
        q_heads = even_split(config.n_heads, world, rank)
        group = config.n_heads // config.n_kv_heads
        runs = [(kv, len(list(heads))) for kv, heads in groupby(q_heads, key=lambda h: h // group)]
        g = math.gcd(*(length for _, length in runs))
        kv_heads = tuple(kv for kv, length in runs for _ in range(length // g))
        vocab_rows = -(-config.vocab_size // world)
        start = min(rank * vocab_rows, config.vocab_size)
        vocab = range(start, min(start + vocab_rows, config.vocab_size))
        return cls(config, rank, world, q_heads, kv_heads, even_split(config.ffn, world, rank), vocab, vocab_rows)

    @property
    def local_config(self) -> ModelConfig:
        """The shard's numbers: the blocks built over it see a smaller model (vocab_size stays the whole, as
        token ids are checked against it)."""
        return replace(self.config, n_heads=len(self.q_heads), n_kv_heads=len(self.kv_heads), ffn=len(self.ffn))


def _take_rows(w: QuantWeight, index: torch.Tensor) -> QuantWeight:
    return QuantWeight(w.words[index].contiguous(), w.sm[index].contiguous(), w.bits, w.group, w.u_max)


class _ShardReader:
    """Reads the rows and columns of GGUF tensors that one rank keeps, as `dtype` on `device`; with `packed`, a
    block-quantized matrix stays packed (QuantWeight) where its cut falls on whole groups."""

    def __init__(self, gguf: GGUFFile, layout: ShardLayout, dtype: torch.dtype, device: torch.device | str,
                 packed: bool = False):
        self.gguf, self.layout, self.dtype, self.device, self.packed = gguf, layout, dtype, device, packed
        self.head_dim = layout.config.head_dim

    def _quant(self, name: str) -> QuantWeight | None:
        return load_packed(self.gguf, name, self.device) if self.packed else None

    def rows(self, name: str, rows: range | torch.Tensor) -> Weight:
        """Rows of a tensor: a range, or any rows (an index)."""
        w = self._quant(name)
        index = torch.arange(rows.start, rows.stop) if isinstance(rows, range) else rows
        if w is not None:
            return _take_rows(w, index)
        if isinstance(rows, range):
            return self.gguf.load_tensor(name, self.dtype, self.device, rows=(rows.start, rows.stop))
        first, last = int(index.min()), int(index.max()) + 1
        return self.gguf.load_tensor(name, self.dtype, self.device, rows=(first, last))[index - first]

    def columns(self, name: str, cols: range) -> Weight:
        """A row-parallel matrix's columns: packed where the cut falls on whole groups, else decoded whole and
        cut (a quantized block may span two ranks' columns), the whole freed at once."""
        w = self._quant(name)
        if w is not None and cols.start % w.group == 0 and cols.stop % w.group == 0:
            per_group = w.group * w.bits // 32  # a group's words are contiguous (quant_weight.py)
            a, b = cols.start // w.group, cols.stop // w.group
            return QuantWeight(w.words[:, a * per_group : b * per_group].contiguous(), w.sm[:, a:b].contiguous(),
                               w.bits, w.group, w.u_max)
        return self.gguf.load_tensor(name, self.dtype, self.device)[:, cols.start : cols.stop].contiguous()

    def heads(self, name: str, heads: range) -> Weight:
        """Rows of contiguous heads (a Q product or bias)."""
        return self.rows(name, range(heads.start * self.head_dim, heads.stop * self.head_dim))

    def kv(self, name: str) -> Weight:
        """Rows of the local KV heads, copies included, of a K or V product or bias."""
        heads = torch.tensor(self.layout.kv_heads)
        return self.rows(name, (heads[:, None] * self.head_dim + torch.arange(self.head_dim)).reshape(-1))

    def vocab(self, name: str, packed: bool = False) -> Weight:
        """The rank's vocabulary rows, padded with zero rows to vocab_rows; packed only where asked (an embedding
        table is looked up, so it stays float)."""
        w = self._quant(name) if packed else None
        pad = self.layout.vocab_rows - len(self.layout.vocab)
        if w is not None:
            part = _take_rows(w, torch.arange(self.layout.vocab.start, self.layout.vocab.stop))
            if not pad:
                return part
            return QuantWeight(torch.cat([part.words, part.words.new_zeros((pad, part.words.shape[1]))]),
                               torch.cat([part.sm, part.sm.new_zeros((pad, *part.sm.shape[1:]))]), w.bits, w.group,
                               w.u_max)
        rows = self.gguf.load_tensor(name, self.dtype, self.device, rows=(self.layout.vocab.start,
                                                                          self.layout.vocab.stop))
        return torch.cat([rows, rows.new_zeros((pad, rows.shape[1]))]) if pad else rows


def load_shard(gguf: GGUFFile, layout: ShardLayout, dtype: torch.dtype, device: torch.device | str,
               progress: bool = True, weight_format: str = "float") -> ModelWeights:
    """One rank's weights: the layout's rows and columns of each matrix, the norms whole. Matrices in
    `weight_format` ("float", "gguf": the file's blocks kept packed where a cut falls on whole groups, "q8");
    column-parallel matrices and the vocabulary are read as their rows only."""
    cfg = layout.config
    r = _ShardReader(gguf, layout, dtype, device, packed=weight_format == "gguf")
    q_cols = range(layout.q_heads.start * cfg.head_dim, layout.q_heads.stop * cfg.head_dim)

    def whole(name: str) -> torch.Tensor:
        return gguf.load_tensor(name, dtype, device)

    def vector(w: Weight) -> torch.Tensor:
        assert isinstance(w, torch.Tensor)  # a bias: never packed
        return w

    layers = []
    for i in tqdm(range(cfg.n_layers), desc="load shard", unit="layer", disable=not progress, leave=False):
        p = f"blk.{i}."
        bqkv = None
        if cfg.qkv_bias:
            bqkv = torch.cat([vector(r.heads(p + "attn_q.bias", layout.q_heads)), vector(r.kv(p + "attn_k.bias")),
                              vector(r.kv(p + "attn_v.bias"))])
        layers.append(LayerWeights(
            attn_norm=whole(p + "attn_norm.weight"),
            wqkv=fuse_matrices([r.heads(p + "attn_q.weight", layout.q_heads), r.kv(p + "attn_k.weight"),
                                r.kv(p + "attn_v.weight")], dtype),
            bqkv=bqkv,
            q_norm=whole(p + "attn_q_norm.weight") if cfg.qk_norm else None,
            k_norm=whole(p + "attn_k_norm.weight") if cfg.qk_norm else None,
            wo=r.columns(p + "attn_output.weight", q_cols),
            ffn_norm=whole(p + "ffn_norm.weight"),
            w_gate_up=fuse_matrices([r.rows(p + "ffn_gate.weight", layout.ffn),
                                     r.rows(p + "ffn_up.weight", layout.ffn)], dtype),
            w_down=r.columns(p + "ffn_down.weight", layout.ffn),
        ))
    embed = vector(r.vocab("token_embd.weight"))
    output = r.vocab("token_embd.weight" if cfg.tied_embeddings else "output.weight", packed=True)
    weights = ModelWeights(embed=embed, layers=layers, out_norm=whole("output_norm.weight"), output=output)
    return quantize_weights(weights, weight_format)
