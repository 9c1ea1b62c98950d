"""`specserve remote-host`: own the device, the weights and the KV caches for fronts that have no GPU
(`serve | generate | bench --remote ADDR`)."""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from specserve import catalog
from specserve.cli.args import add_batch_invariant_arg
from specserve.engine.local_runner import LocalRunner
from specserve.errors import SpecserveError
from specserve.remote.host import serve
from specserve.remote.protocol import ProtocolError, Status, parse_address


def load_runner(model: str, n_seqs: int, n_ctx: int, kv_size: int, weight_format: str, device: str) -> LocalRunner:
    """A front's load request, with the protocol's status for each way it can fail."""
    try:
        path = catalog.resolve(model or None)
    except SpecserveError as exc:
        raise ProtocolError(Status.FILE_MISSING, str(exc)) from None
    try:
        runner = LocalRunner(path, n_seqs=n_seqs, n_ctx=n_ctx or None, kv_size=kv_size or None,
                             device=device or None, progress=False,
                             weight_format=weight_format or "auto")
    except torch.cuda.OutOfMemoryError as exc:
        raise ProtocolError(Status.OUT_OF_MEMORY, str(exc)) from None
    except SpecserveError as exc:
        message = str(exc)
        status = (Status.FILE_MISSING if "not found" in message
                  else Status.UNSUPPORTED if "unsupported" in message or "not a GGUF" in message
                  else Status.INIT_FAILED)
        raise ProtocolError(status, message) from None
    except Exception as exc:
        raise ProtocolError(Status.INIT_FAILED, f"{type(exc).__name__}: {exc}") from None
    runner.warmup(max_rows=min(n_seqs * 17, 256))
    return runner


def cmd_remote_host(args: argparse.Namespace) -> int:
    try:
        parse_address(args.listen)
    except ValueError as exc:
        raise SpecserveError(f"--listen: {exc}") from None
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    def ready(address: str) -> None:
        print(f"specserve remote-host: listening on {address}", file=sys.stderr, flush=True)

    serve(args.listen, load_runner, token=args.token, ready=ready)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("remote-host", help="serve this machine's device to fronts without one (--remote)")
    p.add_argument("--listen", required=True, help="unix:PATH or tcp:HOST:PORT (TCP: 127.0.0.1 unless a token is set)")
    p.add_argument("--token", default=None, help="shared token the fronts must present (required off loopback)")
    add_batch_invariant_arg(p)  # the kernels run here, not on the front
    p.set_defaults(func=cmd_remote_host)
