"""Command-line front: specserve models | generate | lookup | serve | bench | remote-host."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from specserve.errors import SpecserveError


def build_parser() -> argparse.ArgumentParser:
    from specserve.cli import bench, generate, lookup, models, remote_host, serve

    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (models, generate, lookup, serve, bench, remote_host):
        command.register(sub)
    return parser


def _torchrun_follower(args: argparse.Namespace) -> Callable[[], int] | None:
    """Under torchrun with --tensor-parallel, every rank but 0 follows rank 0 instead of running the command
    (rank 0 sends it the model to load): what to run then, else None."""
    if getattr(args, "tensor_parallel", 1) <= 1:
        return None
    from specserve.engine.tp_launch import torchrun_env

    env = torchrun_env()
    if env is None or env.rank == 0:
        return None
    from specserve.engine.local_runner import checked_device
    from specserve.engine.tp_worker import follow_torchrun

    device_type = checked_device(args.device).type
    return lambda: follow_torchrun(device_type)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given (router mode passes most of it on)
    func: Callable[[argparse.Namespace], int] = args.func
    if getattr(args, "batch_invariant", False):
        from specserve.kernels import batch_invariant

        os.environ["SPECSERVE_BATCH_INVARIANT"] = "1"  # for the ranks a tensor-parallel run starts
        batch_invariant.enable()
    try:
        follower = _torchrun_follower(args)
        if follower is not None:
            return follower()
        return func(args)
    except SpecserveError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
