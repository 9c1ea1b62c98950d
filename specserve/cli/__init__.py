"""Command-line front: specserve models | generate | lookup | serve | bench | remote-host."""

from __future__ import annotations

import argparse
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except SpecserveError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
