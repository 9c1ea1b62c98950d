"""LocalRunner: a model plus its KV cache on one torch device, driven by Batches (the Runner protocol)."""

from __future__ import annotations

import gc
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from specserve.engine.cuda_graphs import PROMPT_ROWS, RING_ROWS, GraphCache, TreeRows, feed_tokens
from specserve.engine.host_copy import LaunchedStep
from specserve.errors import NotSupported, SpecserveError
from specserve.gguf.reader import GGUFFile
from specserve.kernels.backend import kernels_for
from specserve.kernels.kv_format import COMPUTE, KVTypes, kv_formats
from specserve.kernels.quant_weight import MAX_GEMV_ROWS
from specserve.kernels.settings import settings
from specserve.model.batch import Batch
from specserve.model.config import ModelConfig
from specserve.model.kv_blocks import BLOCK_SIZE
from specserve.model.kv_cache import PagedKV
from specserve.model.kv_ledger import KVLedger
from specserve.model.lora import AdapterScales, attach_adapters, read_adapter
from specserve.model.registry import read_config
from specserve.model.transformer import Transformer
from specserve.model.weights import (
    ModelWeights,
    add_dense_copies,
    load_weights,
    quantize_weights,
    resolve_weight_format,
)

log = logging.getLogger(__name__)

DEFAULT_CTX = 4096  # positions a sequence may reach when not told (the model's context if shorter)
DENSE_COPY_SHARE = 0.25  # packed matrices get dense copies on CUDA if these fit in this share of the card


def dense_copy_budget(device: torch.device) -> int:
    """Bytes the dense copies of packed matrices may take (kernels.linear): none off CUDA or with
    SPECSERVE_DENSE_COPIES=0 (for A/B runs), else a share of the card, at most half of what is free."""
    if device.type != "cuda" or not settings().dense_copies:
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return int(min(total * DENSE_COPY_SHARE, free / 2))


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def checked_device(device: str | torch.device | None) -> torch.device:
    """The device asked for, or a clear error where this machine cannot run it (instead of torch's traceback
    on first use)."""
    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise SpecserveError(f"unknown device '{device}' (use cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch was built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise SpecserveError(f"--device {device}: {why}; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise SpecserveError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) here")
    elif dev.type != "cpu":
        raise SpecserveError(f"unsupported device '{device}' (use cpu, cuda or cuda:N)")
    return dev


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA (tensor cores, half the bytes), fp32 on CPU (exact reference match)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def freeze_gc() -> None:
    """Move every object alive now (weights, captured graphs) out of the garbage collector's
    view. A forward allocates many short-lived objects, and each collection would otherwise
    walk all the long-lived ones too: with two models loaded that host time halved the
    prefill rate on an H200 (pp512 24k vs 43k tok/s)."""
    gc.collect()
    gc.freeze()


class LocalRunner:
    """Runs forward passes for up to `n_seqs` sequences of at most `n_ctx` positions each, which share a KV pool
    of `kv_size` positions (default: n_seqs * n_ctx)."""

    adapters: AdapterScales | None  # LoRA adapters' scales per sequence (None: no adapters loaded)
    token_trees = True

    def __init__(
        self,
        model_path: str | Path,
        *,
        n_seqs: int = 1,
        n_ctx: int | None = None,
        kv_size: int | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        progress: bool = True,
        cuda_graphs: bool = True,
        weight_format: str = "auto",
        mmap: bool = True,
        adapters: Sequence[str | Path] = (),
        kv_types: KVTypes = (None, None),
    ):
        """weight_format: see specserve.model.weights.WEIGHT_FORMATS ("auto": packed on a CPU with the packed-weight
        kernel, else "float": every matrix
        in `dtype`; "gguf" keeps the file's quantization, the fastest for plain decoding on CUDA).
        mmap=False reads the file's tensors into memory first (llama-server's --no-mmap). adapters: LoRA adapter
        files (model/lora.py), each sequence's scales 0 until set_adapter_scales. kv_types: how K and V are
        stored (-ctk, -ctv: kernels/kv_format.py's names; None: the compute dtype)."""
        gguf = GGUFFile(model_path, mmap=mmap)
        config = read_config(gguf.metadata, set(gguf.tensor_names()))
        dev = checked_device(device)
        dt = dtype or default_dtype(dev)
        self.weight_format = resolve_weight_format(weight_format, dev)
        weights = load_weights(gguf, config, dt, dev, progress, self.weight_format)
        self._setup(config, weights, n_seqs, n_ctx, cuda_graphs, kv_size, kv_types)
        self.gguf: GGUFFile | None = gguf
        if adapters:
            self.adapters = attach_adapters(self.model, config, [read_adapter(p) for p in adapters], n_seqs)
            self.adapters.always = self.graphs is not None  # (the graphs capture the adapters' products)

    @classmethod
    def from_weights(cls, config: ModelConfig, weights: ModelWeights, *, n_seqs: int = 1, n_ctx: int | None = None,
                     kv_size: int | None = None, cuda_graphs: bool = True, weight_format: str = "float",
                     kv_types: KVTypes = (None, None)) -> LocalRunner:
        """A runner over weights built elsewhere (e.g. random weights for speed tests); "q8"
        quantizes their matrices in place."""
        runner = cls.__new__(cls)
        runner.weight_format = resolve_weight_format(weight_format)
        runner._setup(config, quantize_weights(weights, weight_format), n_seqs, n_ctx, cuda_graphs, kv_size, kv_types)
        runner.gguf = None
        return runner

    def _setup(self, config: ModelConfig, weights: ModelWeights, n_seqs: int, n_ctx: int | None,
               cuda_graphs: bool, kv_size: int | None = None, kv_types: KVTypes = (None, None)) -> None:
        self.config = config
        self.weights = weights
        self.device = weights.embed.device
        self.kernels = kernels_for(self.device)  # what every op of the model runs on, chosen once
        log.info("kernels: %s", self.kernels.name)
        dense = add_dense_copies(weights, weights.embed.dtype, dense_copy_budget(self.device), self.kernels)
        if dense:
            log.info("dense copies of the packed matrices for steps of many rows: %.2f GB", dense / 1e9)
        self.dtype = weights.embed.dtype
        self.n_ctx = int(n_ctx or min(config.context_length, DEFAULT_CTX))
        if self.n_ctx < 1 or n_seqs < 1 or (kv_size is not None and kv_size < 1):
            raise SpecserveError(f"invalid context size {self.n_ctx}, KV size {kv_size} or sequence count {n_seqs}")
        self.n_ctx = min(self.n_ctx, kv_size or self.n_ctx)  # one sequence may hold the whole pool, no more
        self.n_seqs = n_seqs
        self.model = self._build_model(config, weights)
        self.adapters = None
        cfg = config
        use_graphs = (cuda_graphs and self.device.type == "cuda" and cfg.head_dim in (64, 128, 256)
                      and self.kernels.name == "triton")
        self.ledger = KVLedger(n_seqs, self.n_ctx, config.vocab_size, kv_size, BLOCK_SIZE)
        self.seq_len = self.ledger.seq_len  # (the same list)
        formats = kv_formats(kv_types, cfg.head_dim)
        # With graphs, a scratch block (through a scratch table row) absorbs the writes of padding rows.
        self.kv = PagedKV(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, n_blocks=self.ledger.blocks.n_blocks,
                          n_seqs=n_seqs, n_ctx=self.n_ctx, block_size=BLOCK_SIZE, dtype=self.dtype, device=self.device,
                          scratch=use_graphs, formats=formats)
        if formats != (COMPUTE, COMPUTE):
            self.model.store_cache_apart()
        k_name, v_name = (str(self.dtype).removeprefix("torch.") if f is COMPUTE else f.name for f in formats)
        log.info("KV cache: %d positions, K %s, V %s, %.1f MiB", self.ledger.blocks.n_blocks * BLOCK_SIZE, k_name,
                 v_name, self.kv.n_bytes / 2**20)
        # Packed weights on CUDA take up to MAX_GEMV_ROWS rows per kernel launch and run more as slices:
        # a 17-row step pads to the 24-row graph and costs a 16-row pass plus an 8-row one (about 1.5x a
        # 16-row step on the 1.5B model), so speculative steps keep their drafts within this (None: no limit).
        self.max_step_rows = (MAX_GEMV_ROWS if self.weight_format != "float" and self.kernels.name == "triton"
                              else None)
        self._ring = torch.zeros((2, RING_ROWS), dtype=torch.long, device=self.device)  # see cuda_graphs
        self._launches = 0
        self.graphs = (GraphCache(self._forward_graphable, self.device, pad_seq=n_seqs, pad_slot=self.kv.scratch_slot,
                                  ring=self._ring) if use_graphs else None)
        freeze_gc()

    def _build_model(self, config: ModelConfig, weights: ModelWeights) -> Transformer:
        """The forward the runner drives (a tensor-parallel shard runner builds its rank's instead)."""
        return Transformer(config, weights, self.n_ctx, self.kernels)

    def warmup(self, max_rows: int = 17, prompt_rows: int = PROMPT_ROWS, sequences: int = 0, trees: int = 0) -> None:
        """Capture the CUDA graphs for steps of up to max_rows rows and prompt chunks of up to
        prompt_rows, alone or beside a decode row of each of the other `sequences` a step may serve (0: all),
        and for steps of up to `trees` rows holding token trees (no-op without graphs)."""
        if self.graphs is not None:
            self.graphs.capture_up_to(max_rows, prompt_rows, mixed_picks=sequences or self.n_seqs, trees=trees)
            freeze_gc()

    @property
    def file_bytes(self) -> int:
        """Size of the GGUF file the weights came from (0 for weights built elsewhere)."""
        return self.gguf.path.stat().st_size if self.gguf is not None else 0

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def draft_limit(self, n_max: int) -> int:
        """n_max drafts, fewer where a step of 1 + n_max rows would take a second pass."""
        rows = self.max_step_rows
        return n_max if rows is None else min(n_max, rows - 1)

    def launch(self, batch: Batch, fed: Sequence[int] | None = None, logits: bool = True) -> LaunchedStep:
        """Queue a forward pass; the batch's K/V enter the cache. fed[i] >= 0: row i's token is the argmax of
        batch row fed[i] of the step launched just before on this runner (which wanted that row's logits);
        its entry in batch.tokens is ignored. So the next step can be queued before this one is read. (logits:
        the logits are there either way on this runner.)"""
        admitted = self.ledger.admit(batch, fed)
        self.kv.copy_blocks(admitted.copies)
        parity = self._launches % 2
        self._launches += 1
        tree = batch.tree_layout()
        step = self.graphs.launch(batch, admitted.slots, fed, parity, tree) if self.graphs is not None else None
        if step is None:  # no graph takes a batch of this shape
            step = self._launch_eager(batch, admitted.runs, admitted.slots, fed, parity, tree)
        return step

    def forward(self, batch: Batch) -> torch.Tensor:
        """fp32 logits [rows wanting logits, vocab]; the batch's K/V enter the cache."""
        return self.launch(batch).logits()

    def _forward_graphable(self, tokens: torch.Tensor, positions: torch.Tensor, seq_ids: torch.Tensor,
                           slots: torch.Tensor, logit_rows: torch.Tensor | None,
                           tree: TreeRows | None = None) -> torch.Tensor:
        """Logits of logit_rows (None: every row), with no host-side batch layout (what CUDA graphs
        capture)."""
        # (graphs that pick logit rows are the prompt steps')
        return self.model.forward(tokens, positions, seq_ids, logit_rows, [],
                                  self.kv.step(slots, tree, prompt=logit_rows is not None))

    def _launch_eager(self, batch: Batch, runs: list[tuple[int, int, int, int]], slots: list[int],
                      fed: Sequence[int] | None, parity: int,
                      tree: tuple[list[int], list[int]] | None = None) -> LaunchedStep:
        dev = self.device

        def on_device(values: Sequence[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long).to(dev, non_blocking=True)

        wanted = batch.logit_rows()
        rows = on_device(wanted)
        with torch.inference_mode():
            tokens = on_device(batch.tokens)
            if fed is not None:
                tokens = feed_tokens(tokens, on_device(fed), self._ring[1 - parity])
            tree_rows = (on_device(tree[0]), on_device(tree[1])) if tree is not None else None
            logits = self.model.forward(tokens, on_device(batch.positions), on_device(batch.seq_ids), rows, runs,
                                        self.kv.step(on_device(slots), tree_rows, prompt=len(wanted) < len(batch)))
            argmax = self.kernels.argmax(logits)
            self._ring[parity].index_copy_(0, rows, argmax)
        return LaunchedStep(logits, argmax, len(wanted))

    def kv_truncate(self, seq: int, n_keep: int) -> None:
        """Keep the first n_keep positions of a sequence (drops rejected draft tokens)."""
        self.ledger.truncate(seq, n_keep)

    def kv_compact(self, seq: int, start: int, path: Sequence[int]) -> None:
        """A token tree written at positions start.. of the sequence: keep its accepted path's nodes (offsets from
        start, the root first) as positions start.., and drop the rest (model/token_tree.py)."""
        moves = [(node, i) for i, node in enumerate(path) if node != i]
        if moves:
            slots = self.ledger.blocks.slots(seq, start, start + max(path) + 1)
            self.kv.move_rows([slots[a] for a, _ in moves], [slots[b] for _, b in moves])
        self.ledger.truncate(seq, start + len(path))

    def kv_cache(self, seq: int, names: Sequence[int]) -> None:
        """Name the sequence's full blocks by content (kv_blocks.content_hashes of its tokens) for kv_attach."""
        self.ledger.cache(seq, names)

    def kv_attach(self, seq: int, names: Sequence[int]) -> int:
        """The sequence takes the cached blocks of the longest run of `names` (held once, copied only when one of
        their holders writes into one); the positions it now holds."""
        n = self.ledger.attach(seq, names)
        self.kv.set_table(seq, self.ledger.blocks.tables[seq])
        return n

    def set_adapter_scales(self, seq: int, scales: tuple[float, ...]) -> None:
        if self.adapters is not None:
            self.adapters.set(seq, scales)
        elif scales:
            raise NotSupported("this runner has no LoRA adapters (--lora)")

    def hidden_states(self, batch: Batch) -> torch.Tensor:
        """Eager (no graph captures it: embeddings are off the decode path); fp32 [wanted rows, hidden]."""
        admitted = self.ledger.admit(batch, None)
        self.ledger.last_rows = 0  # it leaves no argmax ring: nothing may be fed from it
        self.kv.copy_blocks(admitted.copies)
        dev = self.device
        with torch.inference_mode():
            def on_device(values: Sequence[int]) -> torch.Tensor:
                return torch.tensor(values, dtype=torch.long).to(dev)

            return self.model.hidden(on_device(batch.tokens), on_device(batch.positions), on_device(batch.seq_ids),
                                     on_device(batch.logit_rows()), admitted.runs,
                                     self.kv.step(on_device(admitted.slots)))

    def kv_read(self, seq: int) -> torch.Tensor:
        blocks = self.ledger.blocks
        return self.kv.read(blocks.slots(seq, 0, self.seq_len[seq]))

    def kv_read_cached(self, names: Sequence[int]) -> torch.Tensor:
        size = self.ledger.blocks.block_size
        return self.kv.read([b * size + i for b in self.ledger.blocks.cached_blocks(names) for i in range(size)])

    def kv_write(self, seq: int, kv: torch.Tensor) -> None:
        cfg = self.config
        shape = (cfg.n_layers, 2, cfg.n_kv_heads, cfg.head_dim)
        if kv.dim() != 5 or (kv.shape[0], kv.shape[1], kv.shape[2], kv.shape[4]) != shape:
            raise SpecserveError(f"a KV cache of shape {tuple(kv.shape)} does not fit this model's "
                                 f"[{shape[0]}, 2, {shape[2]}, n, {shape[3]}]")
        slots = self.ledger.restore(seq, kv.shape[3])
        self.kv.set_table(seq, self.ledger.blocks.tables[seq])
        self.kv.write(slots, kv)

    def memory_info(self) -> dict[str, int]:
        return {"weights_bytes": self.weights.n_bytes(), "kv_bytes": self.kv.n_bytes}
