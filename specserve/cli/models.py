"""`specserve models list | pull | path`."""

from __future__ import annotations

import argparse

from specserve import catalog


def cmd_models(args: argparse.Namespace) -> int:
    if args.action == "list":
        for row in catalog.listing():
            mark = "installed" if row["installed"] else "-"
            size = row["bytes"]
            assert isinstance(size, int)
            print(f"{row['name']:<22} {size / 1e6:9.1f} MB  {mark:<10} {row['description']}")
    elif args.action == "pull":
        print(catalog.pull(args.name, force=args.force))
    elif args.action == "path":
        print(catalog.resolve(args.name))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list, pull or locate the catalog models")
    msub = p.add_subparsers(dest="action", required=True)
    msub.add_parser("list", help="known models and whether they are installed")
    pull = msub.add_parser("pull", help="download, join and verify a model")
    pull.add_argument("name")
    pull.add_argument("--force", action="store_true", help="fetch again even if installed")
    path = msub.add_parser("path", help="print the local path of a model (pulls it first if needed)")
    path.add_argument("name")
    p.set_defaults(func=cmd_models)
