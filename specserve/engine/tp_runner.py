"""Tensor-parallel runners: rank 0's `TensorParallelRunner` (the Runner protocol, what the scheduler drives)
and the loop the other ranks follow it in.

Rank 0 runs everything above the runner (scheduler, speculators, sampling, HTTP). Each call that changes the
ranks' state, a launch, kv_truncate, kv_cache or kv_attach, is checked on rank 0 first (a bad batch is refused
before any rank hears of it), then broadcast to the followers as host integers over the gloo control group (a header,
then for a launch the batch's tokens, positions, sequence ids, wanted rows and fed rows), and then run by
every rank on its shard: the same LocalRunner code (`ShardRunner`) with the rank's ShardedTransformer, whose
collectives keep the ranks in step inside the forward. Every rank ends a step with all the logits and the
same argmax, so fed rows (the next step's tokens taken on the device) work on each rank as on one.

A rank that fails leaves the others inside a collective or waiting for a command: rank 0's runner then
raises on that call and on every later one (it cannot know how far the others got), and the followers end
when rank 0 does (a closed socket fails their wait; spawned ones also watch their parent process).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from specserve.engine.host_copy import LaunchedStep
from specserve.engine.local_runner import DEFAULT_CTX, LocalRunner, checked_device, default_dtype
from specserve.engine.tp_launch import RankGroup, start_rank0
from specserve.errors import NotSupported, SpecserveError
from specserve.gguf.reader import GGUFFile
from specserve.model.batch import Batch
from specserve.model.config import ModelConfig
from specserve.model.registry import read_config
from specserve.model.tp_layout import ShardLayout, check_tensor_parallel, load_shard
from specserve.model.tp_transformer import ShardedTransformer
from specserve.model.transformer import Transformer
from specserve.model.weights import ModelWeights, resolve_weight_format

log = logging.getLogger(__name__)

LAUNCH, TRUNCATE, CACHE, ATTACH, STOP = range(5)  # command headers: [op, a, b] (launch: rows, has fed; cache and
# attach: the sequence and how many names follow)
HEADER = 3


def names_payload(names: Sequence[int]) -> torch.Tensor | None:
    """Block names (kv_cache, kv_attach) as the tensor that follows their header (none for no names)."""
    return torch.tensor(list(names), dtype=torch.long) if names else None


class ShardRunner(LocalRunner):
    """A LocalRunner over one rank's shard: eager steps (no CUDA graphs: gloo's collectives cannot be captured,
    and NCCL's are not captured here yet), its matrices in the resolved weight format (tp_layout.load_shard)."""

    def __init__(self, gguf: GGUFFile, group: RankGroup, *, n_seqs: int, n_ctx: int, dtype: torch.dtype,
                 progress: bool = False, kv_size: int | None = None, weight_format: str = "float"):
        config = read_config(gguf.metadata, set(gguf.tensor_names()))
        self.layout = ShardLayout.plan(config, group.rank, group.world)
        self.group = group
        self.weight_format = weight_format
        weights = load_shard(gguf, self.layout, dtype, group.device, progress, weight_format)
        self._setup(self.layout.local_config, weights, n_seqs, n_ctx, cuda_graphs=False, kv_size=kv_size)
        self.config = config  # the whole model's numbers (what /props shows); the shard's: layout.local_config
        self.gguf: GGUFFile | None = gguf

    def _build_model(self, config: ModelConfig, weights: ModelWeights) -> Transformer:
        return ShardedTransformer(self.layout, weights, self.n_ctx, self.group.comm, self.kernels)


class TensorParallelRunner(ShardRunner):
    """Rank 0: a ShardRunner whose state-changing calls are first sent to the followers. (memory_info and
    `weights` are rank 0's shard; each other rank holds about as much.)"""

    token_trees = False  # (the followers are sent rows, not trees)

    def __init__(self, gguf: GGUFFile, group: RankGroup, *, n_seqs: int, n_ctx: int, dtype: torch.dtype,
                 progress: bool = False, kv_size: int | None = None, weight_format: str = "float"):
        super().__init__(gguf, group, n_seqs=n_seqs, n_ctx=n_ctx, dtype=dtype, progress=progress, kv_size=kv_size,
                         weight_format=weight_format)
        self._lock = threading.Lock()  # the scheduler's thread sends commands; close() may come from another
        self._broken: str | None = None
        self._closed = False

    def launch(self, batch: Batch, fed: Sequence[int] | None = None, logits: bool = True) -> LaunchedStep:
        with self._lock:
            self._check_alive()
            self.ledger.check(batch, batch.runs(), fed)  # refused here: no rank hears of it
            has_fed = fed is not None
            rows = [batch.tokens, batch.positions, batch.seq_ids, [int(w) for w in batch.want_logits]]
            payload = torch.tensor(rows + ([list(fed)] if fed is not None else []), dtype=torch.long)
            try:
                self._send([LAUNCH, len(batch), int(has_fed)], payload)
                return super().launch(batch, fed, logits)
            except Exception as exc:
                raise self._fail(exc) from exc

    def kv_compact(self, seq: int, start: int, path: Sequence[int]) -> None:
        raise NotSupported("token trees are not verified across tensor-parallel ranks")

    def kv_truncate(self, seq: int, n_keep: int) -> None:
        with self._lock:
            self._check_alive()
            super().kv_truncate(seq, n_keep)  # checked and done here first: a refused call is never sent
            self._send_or_fail([TRUNCATE, seq, n_keep])

    def kv_cache(self, seq: int, names: Sequence[int]) -> None:
        with self._lock:
            self._check_alive()
            super().kv_cache(seq, names)
            self._send_or_fail([CACHE, seq, len(names)], names_payload(names))

    def kv_attach(self, seq: int, names: Sequence[int]) -> int:
        with self._lock:
            self._check_alive()
            n = super().kv_attach(seq, names)
            self._send_or_fail([ATTACH, seq, len(names)], names_payload(names))
            return n

    # Embeddings and slot files would need commands of their own on every rank: not done yet.
    def hidden_states(self, batch: Batch) -> torch.Tensor:
        raise NotSupported("embeddings are not supported with --tensor-parallel yet")

    def kv_read(self, seq: int) -> torch.Tensor:
        raise NotSupported("slot save/restore is not supported with --tensor-parallel yet")

    def kv_write(self, seq: int, kv: torch.Tensor) -> None:
        raise NotSupported("slot save/restore is not supported with --tensor-parallel yet")

    def kv_read_cached(self, names: Sequence[int]) -> torch.Tensor:
        raise NotSupported("the host prompt cache is not supported with --tensor-parallel yet")

    def close(self) -> None:
        """Stop the followers (a STOP command, then waiting for the ones spawned here), leave the group.
        Idempotent; also run at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        # A scheduler thread stuck in a collective (a dead rank) holds the lock: then end the followers.
        locked = self._lock.acquire(timeout=5.0)
        try:
            if locked and self._broken is None:
                try:
                    self._send([STOP, 0, 0])
                except Exception as exc:  # a follower gone already: nothing to stop there
                    log.warning("tensor parallel: stopping the followers: %s", exc)
            self.group.stop_followers(grace=10.0 if locked and self._broken is None else 0.0)
            if locked:
                self.group.destroy()
        finally:
            if locked:
                self._lock.release()

    def _send(self, header: list[int], payload: torch.Tensor | None = None) -> None:
        dist.broadcast(torch.tensor(header, dtype=torch.long), 0, group=self.group.control)
        if payload is not None:
            dist.broadcast(payload, 0, group=self.group.control)

    def _send_or_fail(self, header: list[int], payload: torch.Tensor | None = None) -> None:
        try:
            self._send(header, payload)
        except Exception as exc:
            raise self._fail(exc) from exc

    def _check_alive(self) -> None:
        if self._closed:
            raise SpecserveError("tensor parallel: the runner is closed")
        if self._broken is not None:
            raise SpecserveError(f"tensor parallel: {self._broken}; restart to serve again")

    def _fail(self, exc: Exception) -> SpecserveError:
        gone = self.group.exited_followers()
        self._broken = (f"{', '.join(gone)} ended" if gone else f"a rank failed ({type(exc).__name__}: {exc})")
        log.error("tensor parallel: %s", self._broken)
        return SpecserveError(f"tensor parallel: {self._broken}; the ranks are out of step")


def start_tensor_parallel(model_path: str | Path, world: int, *, n_seqs: int = 1, n_ctx: int | None = None,
                          kv_size: int | None = None, device: str | torch.device | None = None,
                          dtype: torch.dtype | None = None, progress: bool = True, weight_format: str = "auto",
                          **_: object) -> TensorParallelRunner:
    """Rank 0's runner of a model split over `world` ranks (the others started here, or by torchrun), in the
    weight format asked for ("auto" as for one process: packed on a CPU with the kernels); on CUDA float only
    (the packed kernels' shards have not run there). The model is checked before any process starts."""
    dev = checked_device(device)
    weight_format = resolve_weight_format(weight_format, dev)
    if dev.type != "cpu" and weight_format != "float":
        raise SpecserveError(f"--tensor-parallel on {dev.type} loads float weights only (--weight-format float or "
                             f"auto), not {weight_format}")
    gguf = GGUFFile(model_path)
    config = read_config(gguf.metadata, set(gguf.tensor_names()))
    check_tensor_parallel(config, world, set(gguf.tensor_names()))
    dt = dtype or default_dtype(dev)
    ctx = int(n_ctx or min(config.context_length, DEFAULT_CTX))
    spec = {"path": str(Path(model_path).resolve()), "n_seqs": n_seqs, "n_ctx": ctx, "kv_size": kv_size,
            "dtype": str(dt).removeprefix("torch."), "weight_format": weight_format}
    t0 = time.monotonic()
    group = start_rank0(world, dev.type)
    log.info("tensor parallel: %d ranks joined in %.1f s", world, time.monotonic() - t0)
    runner: TensorParallelRunner | None = None
    error: str | None = None
    try:
        dist.broadcast_object_list([spec], 0, group=group.control)
        try:
            runner = TensorParallelRunner(gguf, group, n_seqs=n_seqs, n_ctx=ctx, dtype=dt,
                                          progress=progress, kv_size=kv_size, weight_format=weight_format)
        except Exception as exc:  # told to the followers below, so that they end too
            error = str(exc) if isinstance(exc, SpecserveError) else f"{type(exc).__name__}: {exc}"
        errors = _exchange_status(group, error)
    except Exception as exc:  # a follower gone while loading
        gone = group.exited_followers()
        errors = [f"{', '.join(gone)} ended" if gone else f"{type(exc).__name__}: {exc}"]
    if errors:
        group.stop_followers(grace=10.0)
        group.destroy()
        raise SpecserveError("tensor parallel: loading failed: " + "; ".join(errors))
    assert runner is not None
    log.info("tensor parallel: shards loaded, %.1f s since the start", time.monotonic() - t0)
    atexit.register(runner.close)
    return runner


def _exchange_status(group: RankGroup, error: str | None) -> list[str]:
    """Every rank's load outcome, to every rank: 'rank R: why' for each that failed."""
    status: list[str | None] = [None] * group.world
    dist.all_gather_object(status, error, group=group.control)
    return [f"rank {r}: {e}" for r, e in enumerate(status) if e is not None]


def follow(group: RankGroup) -> int:
    """A follower's life: load the shard rank 0 names, then run rank 0's commands until STOP. The exit code."""
    received: list[object] = [None]
    dist.broadcast_object_list(received, 0, group=group.control)
    spec = received[0]
    assert isinstance(spec, dict)
    shard: ShardRunner | None = None
    error: str | None = None
    try:
        shard = ShardRunner(GGUFFile(spec["path"]), group, n_seqs=spec["n_seqs"], n_ctx=spec["n_ctx"],
                            dtype=getattr(torch, spec["dtype"]), kv_size=spec["kv_size"],
                            weight_format=spec["weight_format"])
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    if _exchange_status(group, error):
        group.destroy()
        return 1
    assert shard is not None
    header = torch.zeros(HEADER, dtype=torch.long)
    while True:
        dist.broadcast(header, 0, group=group.control)
        op, a, b = header.tolist()
        if op == STOP:
            group.destroy()
            return 0
        if op == LAUNCH:
            payload = torch.empty((4 + b, a), dtype=torch.long)
            dist.broadcast(payload, 0, group=group.control)
            tokens, positions, seq_ids, wanted, *fed = payload.tolist()
            shard.launch(Batch(tokens, positions, seq_ids, [bool(w) for w in wanted]), fed[0] if fed else None)
        elif op == TRUNCATE:
            shard.kv_truncate(a, b)
        elif op in (CACHE, ATTACH):
            names = torch.empty(b, dtype=torch.long)
            if b:
                dist.broadcast(names, 0, group=group.control)
            (shard.kv_cache if op == CACHE else shard.kv_attach)(a, names.tolist())
        else:
            raise SpecserveError(f"tensor parallel: unknown command {op} from rank 0")
