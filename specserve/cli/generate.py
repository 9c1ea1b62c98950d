"""`specserve generate`: one prompt, streamed to stdout, timings to stderr."""

from __future__ import annotations

import argparse
import sys

from specserve.cli.args import add_model_args, add_sampling_args, add_spec_args
from specserve.cli.serve_flags import LoraFiles
from specserve.cli.session import GenerationSession
from specserve.errors import SpecserveError


def cmd_generate(args: argparse.Namespace) -> int:
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


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt")
    add_model_args(p)
    p.add_argument("-p", "--prompt", default=None)
    p.add_argument("-f", "--file", default=None, help="read the prompt from a file")
    p.add_argument("-n", "--n-predict", type=int, default=128)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--lora", action=LoraFiles, dest="lora", default=[], metavar="FNAME",
                   help="a LoRA adapter (llama.cpp's GGUF adapter file) at scale 1; repeat or comma-separate")
    p.add_argument("--lora-scaled", action=LoraFiles, dest="lora", metavar="FNAME:SCALE",
                   help="a LoRA adapter at a scale of its own")
    add_sampling_args(p)
    add_spec_args(p)
    p.set_defaults(func=cmd_generate)
