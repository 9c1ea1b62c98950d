"""Loading the served model: the target's runner and, with a draft model, the draft's — here, or on a
remote host (`--remote ADDR`: remote/client.py), where the model names are resolved by the host."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specserve import catalog
from specserve.engine.local_runner import LocalRunner
from specserve.engine.runner import Runner, model_file
from specserve.engine.tp_runner import start_tensor_parallel
from specserve.errors import NotSupported
from specserve.gguf.vocab_check import check_vocab_compatible
from specserve.kernels.kv_format import KVTypes
from specserve.remote.client import RemoteRunner
from specserve.remote.protocol import STEP_TIMEOUT


@dataclass(frozen=True)
class RemoteOptions:
    address: str  # unix:PATH or tcp:HOST:PORT of a `specserve remote-host`
    token: str | None = None
    timeout: float = STEP_TIMEOUT  # seconds of silence (no reply, no keep-alive) before the host counts as gone


def load_with_draft(model: str | None, draft: str | None, *, remote: RemoteOptions | None = None,
                    tensor_parallel: int = 1, adapters: Sequence[str | Path] = (),
                    draft_kv_types: KVTypes | None = None, **runner_args: Any) -> tuple[Runner, Runner | None, Path]:
    """The target's runner, the draft's if a draft model is given (same settings, context and KV size,
    vocabulary checked against the target's), and the target's path (on the host, for a remote one).
    tensor_parallel > 1: the target split over that many ranks (tp_runner.py); the draft runs on rank 0 alone.
    adapters: LoRA adapter files for the target (a local runner on one device only). draft_kv_types: the draft's
    -ctkd/-ctvd (None: the target's kv_types)."""
    if adapters and (remote is not None or tensor_parallel > 1):
        raise NotSupported("LoRA adapters (--lora) need the model on this machine's one device: not with --remote "
                           "or --tensor-parallel")
    kv_types = (*runner_args.get("kv_types", ()), *(draft_kv_types or ()))
    if any(kv_types) and (remote is not None or tensor_parallel > 1):
        raise NotSupported("-ctk/-ctv (KV cache types) need the model on this machine: not with --remote or "
                           "--tensor-parallel")
    if remote is not None:
        return _load_remote(model or catalog.DEFAULT_MODEL, draft, remote, **runner_args)
    path = catalog.resolve(model)
    runner: LocalRunner = (start_tensor_parallel(path, tensor_parallel, **runner_args) if tensor_parallel > 1
                           else LocalRunner(path, adapters=adapters, **runner_args))
    if draft is None:
        return runner, None, path
    draft_args = {**runner_args, "n_ctx": runner.n_ctx}
    if draft_kv_types is not None:
        draft_args["kv_types"] = draft_kv_types
    draft_runner = LocalRunner(catalog.resolve(draft), **draft_args)
    check_vocab_compatible(model_file(runner).metadata, model_file(draft_runner).metadata)
    return runner, draft_runner, path


def _load_remote(model: str, draft: str | None, remote: RemoteOptions, *, n_seqs: int = 1,
                 n_ctx: int | None = None, kv_size: int | None = None, device: str | None = None,
                 weight_format: str = "auto", **_: Any) -> tuple[Runner, Runner | None, Path]:
    def connect(name: str, ctx: int | None) -> RemoteRunner:
        return RemoteRunner(remote.address, name, n_seqs=n_seqs, n_ctx=ctx, kv_size=kv_size,
                            weight_format=weight_format, device=device, token=remote.token, timeout=remote.timeout)

    runner = connect(model, n_ctx)
    if draft is None:
        return runner, None, runner.gguf.path
    draft_runner = connect(draft, runner.n_ctx)
    check_vocab_compatible(runner.gguf.metadata, draft_runner.gguf.metadata)
    return runner, draft_runner, runner.gguf.path
