"""Command-line front: specserve models | generate | lookup (serve and bench join later)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from specserve.errors import SpecserveError


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=os.environ.get("LLAMA_ARG_MODEL"),
                   help="catalog name or GGUF path (default: the embedded default model)")
    p.add_argument("-c", "--ctx-size", type=int, default=None,
                   help="context size per sequence (default: min(model, 4096))")
    p.add_argument("--device", default=None, help="torch device, e.g. cpu or cuda (default: cuda when available)")
    from specserve.model.weights import WEIGHT_FORMATS

    p.add_argument("--weight-format", default="auto", choices=WEIGHT_FORMATS,
                   help="matrices in memory: float (auto); gguf = the file's own quantization kept, 4/8-bit "
                        "(2.5x fewer bytes than bf16, faster one-row decode on CUDA, slower verify steps); "
                        "q8 = Q8_0-style 8-bit")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temp", type=float, default=0.8, help="temperature; <= 0 is greedy (default 0.8)")
    g.add_argument("--top-k", type=int, default=40)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--min-p", type=float, default=0.05)
    g.add_argument("--repeat-penalty", type=float, default=1.0)
    g.add_argument("--repeat-last-n", type=int, default=64)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("-s", "--seed", type=int, default=-1, help="RNG seed (-1 = random)")


def add_spec_args(p: argparse.ArgumentParser) -> None:
    from specserve.speculative.base import SELECTABLE_TYPES, SpecParams

    d = SpecParams()
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--spec-type", default=d.type, help=f"[{'|'.join(SELECTABLE_TYPES)}] (default: none)")
    g.add_argument("--spec-ngram-size-n", type=int, default=d.ngram_size_n)
    g.add_argument("--spec-ngram-size-m", type=int, default=d.ngram_size_m)
    g.add_argument("--spec-ngram-check-rate", type=int, default=d.ngram_check_rate)
    g.add_argument("--spec-ngram-min-hits", type=int, default=d.ngram_min_hits)
    g.add_argument("--draft-max", "--draft", "--draft-n", dest="draft_max", type=int, default=d.n_max)
    g.add_argument("--draft-min", "--draft-n-min", dest="draft_min", type=int, default=d.n_min)
    g.add_argument("--draft-p-min", type=float, default=d.p_min)
    g.add_argument("-md", "--model-draft", default=None, help="draft model: catalog name or GGUF path")
    g.add_argument("-lcs", "--lookup-cache-static", default=None, help="static ngram-cache file (must exist)")
    g.add_argument("-lcd", "--lookup-cache-dynamic", default=None, help="dynamic ngram-cache file (read and updated)")


def spec_params_from_args(args: argparse.Namespace):  # -> SpecParams
    from specserve.speculative.base import SpecParams

    return SpecParams(
        type=args.spec_type, n_max=args.draft_max, n_min=args.draft_min, p_min=args.draft_p_min,
        ngram_size_n=args.spec_ngram_size_n, ngram_size_m=args.spec_ngram_size_m,
        ngram_check_rate=args.spec_ngram_check_rate, ngram_min_hits=args.spec_ngram_min_hits,
        lookup_cache_static=args.lookup_cache_static, lookup_cache_dynamic=args.lookup_cache_dynamic,
    ).validate()


def sampling_params_from_args(args: argparse.Namespace):  # -> SamplingParams
    from specserve.engine.sampling import SamplingParams

    return SamplingParams(
        temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty, seed=args.seed,
    ).validate()


def cmd_models(args: argparse.Namespace) -> int:
    from specserve import catalog

    if args.action == "list":
        for row in catalog.listing():
            mark = "installed" if row["installed"] else "-"
            print(f"{row['name']:<22} {row['bytes'] / 1e6:9.1f} MB  {mark:<10} {row['description']}")
    elif args.action == "pull":
        print(catalog.pull(args.name, force=args.force))
    elif args.action == "path":
        print(catalog.resolve(args.name))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from specserve.session import GenerationSession

    if args.file:
        try:
            with open(args.file, encoding="utf-8") as f:
                args.prompt = f.read()
        except OSError as exc:
            raise SpecserveError(f"cannot read prompt file: {exc}") from None
    if args.prompt is None:
        raise SpecserveError("give a prompt with -p/--prompt or -f/--file")
    if args.n_predict < 1:
        raise SpecserveError("-n/--n-predict must be at least 1")
    session = GenerationSession.from_args(args)
    stats = session.run(args.prompt, chat=args.chat, n_predict=args.n_predict, out=sys.stdout)
    for line in session.report_lines(stats):
        print(line, file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("models", help="list, pull or locate the catalog models")
    msub = p.add_subparsers(dest="action", required=True)
    msub.add_parser("list", help="known models and whether they are installed")
    pull = msub.add_parser("pull", help="download, join and verify a model")
    pull.add_argument("name")
    pull.add_argument("--force", action="store_true", help="fetch again even if installed")
    path = msub.add_parser("path", help="print the local path of a model (pulls it first if needed)")
    path.add_argument("name")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("generate", help="generate text from a prompt")
    add_model_args(p)
    p.add_argument("-p", "--prompt", default=None)
    p.add_argument("-f", "--file", default=None, help="read the prompt from a file")
    p.add_argument("-n", "--n-predict", type=int, default=128)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_sampling_args(p)
    add_spec_args(p)
    p.set_defaults(func=cmd_generate)

    from specserve import bench, lookup_cli

    lookup_cli.register(sub)
    bench.register(sub)
    from specserve.server import cli as server_cli

    server_cli.register(sub)
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
