"""`specserve lookup create | merge | stats`: the n-gram lookup-cache tools on the command line.

The same jobs as llama.cpp's lookup-create, lookup-merge and lookup-stats; the cache files are
interchangeable with theirs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specserve.errors import SpecserveError
from specserve.speculative.lookup import build_static_cache, lookup_stats, merge_cache_files
from specserve.speculative.ngram_cache import NgramCache, load_cache, save_cache

DEFAULT_DRAFT_MAX = 16  # llama.cpp's --draft-max default
DEFAULT_CTX_SIZE = 4096  # chunk length of lookup stats (llama.cpp's default context size)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `lookup` command with its create / merge / stats subcommands."""
    lookup = subparsers.add_parser("lookup", help="build, merge and evaluate n-gram lookup caches",
                                   description="n-gram lookup caches for --spec-type ngram-cache (-lcs / -lcd)")
    sub = lookup.add_subparsers(dest="lookup_command", metavar="{create,merge,stats}", required=True)

    create = sub.add_parser("create", help="build a static lookup cache (2-grams) from a text file")
    _add_model_arg(create)
    create.add_argument("-f", "--file", required=True, help="text file to learn from")
    create.add_argument("-o", "--output", required=True, help="cache file to write")
    create.set_defaults(func=_cmd_create)

    merge = sub.add_parser("merge", help="add the counts of several cache files into one")
    merge.add_argument("inputs", nargs="+", metavar="IN", help="cache files to merge")
    merge.add_argument("-o", "--output", required=True, help="cache file to write")
    merge.set_defaults(func=_cmd_merge)

    stats = sub.add_parser("stats", help="how many tokens of a text the caches would have drafted correctly")
    _add_model_arg(stats)
    stats.add_argument("-f", "--file", required=True, help="text file to replay")
    stats.add_argument("-lcs", "--lookup-cache-static", metavar="FILE", help="static cache (must exist)")
    stats.add_argument("-lcd", "--lookup-cache-dynamic", metavar="FILE",
                       help="dynamic cache (used if it exists; not written)")
    stats.add_argument("--draft-max", type=_positive_int, default=DEFAULT_DRAFT_MAX, metavar="N",
                       help=f"most tokens per draft (default: {DEFAULT_DRAFT_MAX})")
    stats.add_argument("-c", "--ctx-size", type=_ctx_size, default=DEFAULT_CTX_SIZE, metavar="N",
                       help=f"replay the text in chunks of N tokens (default: {DEFAULT_CTX_SIZE})")
    stats.set_defaults(func=_cmd_stats)


def _add_model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-m", "--model", default=None,
                        help="catalog name or GGUF path whose tokenizer is used (default: the default model)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _ctx_size(text: str) -> int:
    value = _positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2, got {value}")
    return value


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecserveError(f"text file not found: {path}") from None
    except UnicodeDecodeError as exc:
        raise SpecserveError(f"{path} is not UTF-8 text: {exc}") from None
    except OSError as exc:
        raise SpecserveError(f"cannot read {path}: {exc.strerror or exc}") from None


def _tokenize_file(model: str | None, path: str) -> list[int]:
    text = _read_text(path)  # a bad path is reported before the slow model imports
    # Imported here: `lookup merge` needs no model, and the model stack is slow to import.
    from specserve import catalog
    from specserve.gguf.reader import GGUFFile
    from specserve.gguf.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(GGUFFile(catalog.resolve(model)))
    print(f"tokenizing {path} ...", file=sys.stderr)
    # Same flags as llama.cpp's common_tokenize(ctx, prompt, add_special=true, parse_special=true).
    return tokenizer.encode(text, add_special=True, parse_special=True)


def _cache_size(cache: NgramCache) -> str:
    return f"{len(cache)} n-grams, {sum(len(part) for part in cache.values())} entries"


def _cmd_create(args: argparse.Namespace) -> int:
    tokens = _tokenize_file(args.model, args.file)
    print(f"{len(tokens)} tokens", file=sys.stderr)
    cache = build_static_cache(tokens, progress=True)
    save_cache(cache, args.output)
    print(f"wrote {args.output}: {_cache_size(cache)}")
    return 0


def _cmd_merge(args: argparse.Namespace) -> int:
    cache = merge_cache_files(args.inputs, progress=True)
    save_cache(cache, args.output)
    print(f"wrote {args.output}: {_cache_size(cache)} from {len(args.inputs)} files")
    return 0


def _cmd_stats(args: argparse.Namespace) -> int:
    static: NgramCache = {}
    if args.lookup_cache_static:
        if not Path(args.lookup_cache_static).is_file():
            raise SpecserveError(f"static lookup cache not found: {args.lookup_cache_static}")
        static = load_cache(args.lookup_cache_static)
    dynamic: NgramCache = {}
    if args.lookup_cache_dynamic and Path(args.lookup_cache_dynamic).exists():
        dynamic = load_cache(args.lookup_cache_dynamic)
    tokens = _tokenize_file(args.model, args.file)
    stats = lookup_stats(tokens, args.draft_max, args.ctx_size, static=static, dynamic=dynamic, progress=True)
    for line in stats.lines():
        print(line)
    return 0
