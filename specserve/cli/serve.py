"""`specserve serve`: the HTTP server, with llama-server's flag names and environment variables."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from specserve.cli.serve_flags import add_llama_server_flags, comma_list, env_name, llama_server_settings, parse_bool
from specserve.cli.serve_router import add_router_args
from specserve.errors import SpecserveError
from specserve.speculative.shared_suffix import DEFAULT_TOKENS

if TYPE_CHECKING:
    from specserve.server.settings import ServerSettings

def _apply_env(parser: argparse.ArgumentParser) -> None:
    """Every flag reads its env var; a flag on the command line wins.

    argparse converts a string default with the flag's `type`, so a bad env value is
    reported like a bad flag value; a boolean flag's value is read here, and a bad one is
    reported by cmd_serve (`env_error`), in one line like any other error.
    """
    for action in parser._actions:
        name = env_name(action)
        if name is None:
            continue
        action.help = f"{action.help or ''} [env: {name}]".strip()
        value = os.environ.get(name)
        if value is None or value == "":
            continue
        if action.nargs == 0:  # store_true: true/false, 1/0, on/off, enabled/disabled
            try:
                parser.set_defaults(**{action.dest: parse_bool(name, value)})
            except SpecserveError as exc:
                parser.set_defaults(env_error=str(exc))
        else:
            parser.set_defaults(**{action.dest: value})


def register(subparsers: argparse._SubParsersAction) -> None:
    from specserve.cli.args import add_model_args, add_sampling_args, add_spec_args
    from specserve.engine.slot_state import POOLINGS

    p = subparsers.add_parser(
        "serve", help="run the HTTP server (llama-server and OpenAI compatible)",
        description="Serve a GGUF model over HTTP: /completion, /v1/completions, /v1/chat/completions, "
                    "/infill, /embedding, /v1/embeddings, /tokenize, /detokenize, /apply-template, /props, /slots, "
                    "/v1/models, /metrics, /health.",
    )
    add_model_args(p)
    for action in p._actions:
        if action.dest == "ctx_size":
            action.help = ("KV positions all slots share, paged: memory follows use and any one slot may reach "
                           "all of them (default: min(model, 4096) per slot, times the slots)")
    g = p.add_argument_group("server")
    g.add_argument("-np", "--parallel", type=int, default=4, help="number of slots decoding together (default 4)")
    g.add_argument("--no-prefix-cache", action="store_true",
                   help="do not cache the KV pool's full blocks by content: a prompt then reuses only its own slot's "
                        "cache, not another slot's prompt, a conversation's earlier turns kept after its slot moved "
                        "on, or another tenant's system prompt (cached blocks are given up least recently used "
                        "first when the pool is short)")
    g.add_argument("-b", "--batch-size", type=int, default=512,
                   help="most tokens in one forward pass for prompt processing (default 512)")
    g.add_argument("--draft-policy", choices=("adaptive", "gated", "always"), default="adaptive",
                   help="adaptive: with a few slots busy, draft only while drafting measurably gives more "
                        "tokens/s, with more, draft in chained steps (the default); gated: as adaptive, but with "
                        "more slots busy nothing drafts; always: draft whenever a request's speculator can")
    g.add_argument("--core-in-process", action="store_true",
                   help="run the scheduler and the model in a thread of the HTTP server's process instead of a "
                        "process of their own (the engine core: server/core_process.py)")
    g.add_argument("-v", "--verbose", "--log-verbose", action="store_true",
                   help="debug logs, and OpenAI answers carry `__verbose`: the native /completion body, as "
                        "llama-server's")
    g.add_argument("--spec-shared-tokens", type=int, default=DEFAULT_TOKENS, metavar="N",
                   help="ngram-suffix also drafts from earlier requests (prompts and outputs) of the same API key "
                        "and speculative.scope: tokens kept for that in all, least recently used out first "
                        f"(default {DEFAULT_TOKENS}; 0: off)")
    g.add_argument("-n", "--n-predict", type=int, default=-1,
                   help="default tokens to generate per request (-1 = until end or full context)")
    g.add_argument("--host", default="127.0.0.1",
                   help="addresses to listen on, comma-separated, or a UNIX socket path ending in .sock "
                        "(default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    g.add_argument("--api-key", default=None,
                   help="require this key, or one of several separated by commas (Authorization: Bearer KEY or "
                        "X-Api-Key); each key's requests draft only from their own earlier requests")
    g.add_argument("--api-key-file", default=None, metavar="FNAME",
                   help="API keys, one per line (lines starting with # are comments), besides --api-key's")
    g.add_argument("-a", "--alias", default=None,
                   help="model names the API accepts, comma-separated; the first is shown (default: the model's)")
    g.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024,
                   help="largest request body accepted; larger ones get 413 (default 8 MiB)")
    g.add_argument("--max-queue", type=int, default=256,
                   help="generation requests that may wait for a free slot; more get 503 with Retry-After "
                        "(default 256)")
    g.add_argument("--responses-store", type=int, default=256, metavar="N",
                   help="past /v1/responses answers kept in memory for previous_response_id, the least recently "
                        "used given up first, each for an hour at most (default 256; 0: none)")
    g.add_argument("--cors-origins", default="*",
                   help="browser origins allowed to call the API, comma-separated; '' for none (default *)")
    g.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds running requests may take to finish after SIGTERM before they are ended "
                        "(default 10)")
    g.add_argument("--slot-save-path", default=None, metavar="DIR",
                   help="directory for POST /slots/{id}?action=save|restore files (created if missing; without it "
                        "those actions answer 501, as llama-server)")
    g.add_argument("--pooling", choices=POOLINGS, default=None,
                   help="how /embedding(s) pool the final hidden states: mean (the default, unless the GGUF names "
                        "last-token pooling) or last")
    g.add_argument("--embedding", "--embeddings", dest="embedding", action="store_true",
                   help="accepted for llama-server's command lines: the embedding endpoints are always served")
    g.add_argument("-t", "--threads", type=int, default=None, help="CPU threads for torch (default: torch's)")
    add_llama_server_flags(g)
    add_router_args(g)
    add_sampling_args(p)
    add_spec_args(p)
    _apply_env(p)
    p.set_defaults(func=cmd_serve, serve_parser=p)  # (router mode reads --models-preset keys against it)


def api_keys(args: argparse.Namespace) -> str | None:
    """--api-key's keys and those of --api-key-file, comma-separated (SpecserveError for an unreadable file)."""
    keys = [args.api_key] if args.api_key else []
    if args.api_key_file:
        try:
            lines = Path(args.api_key_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            why = getattr(exc, "strerror", None) or exc
            raise SpecserveError(f"--api-key-file {args.api_key_file}: {why}") from None
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    return ",".join(keys) or None


def server_settings(args: argparse.Namespace) -> ServerSettings:
    """The server's settings from the parsed flags, checked (SpecserveError: one line, nothing loaded)."""
    from specserve.cli.args import (
        kv_types_from_args,
        remote_from_args,
        sampling_params_from_args,
        spec_params_from_args,
        tensor_parallel_from_args,
    )
    from specserve.server.settings import ServerSettings, check_settings

    if getattr(args, "env_error", None):
        raise SpecserveError(args.env_error)
    if not 0 <= args.port <= 65535:
        raise SpecserveError(f"--port {args.port} is not a TCP port")
    if not args.shutdown_grace >= 0:
        raise SpecserveError(f"--shutdown-grace must be a number of seconds (0 or more), got {args.shutdown_grace}")
    if args.threads is not None and args.threads < 1:
        raise SpecserveError(f"-t/--threads must be at least 1, got {args.threads}")
    settings = ServerSettings(
        model=args.model, model_draft=args.model_draft, ctx_size=args.ctx_size, n_parallel=args.parallel,
        prefix_cache=not args.no_prefix_cache,
        n_batch=args.batch_size, adaptive_drafts=args.draft_policy != "always",
        chain_drafts=args.draft_policy == "adaptive", n_predict=args.n_predict, verbose=args.verbose,
        spec_shared_tokens=args.spec_shared_tokens, core_process=not args.core_in_process, threads=args.threads,
        device=args.device, alias=args.alias,
        weight_format=args.weight_format, kv_types=kv_types_from_args(args),
        draft_kv_types=kv_types_from_args(args, draft=True), remote=remote_from_args(args),
        tensor_parallel=tensor_parallel_from_args(args),
        max_body_bytes=args.max_body_bytes, max_queue=args.max_queue, responses_store=args.responses_store,
        cors_origins=comma_list(args.cors_origins),
        slot_save_path=args.slot_save_path, pooling=args.pooling,
        sampling=sampling_params_from_args(args), spec=spec_params_from_args(args),
        **llama_server_settings(args),
    )
    check_settings(settings)
    settings.kv_size()
    static = settings.spec.lookup_cache_static
    if static is not None and not os.path.isfile(static):
        raise SpecserveError(f"static lookup cache not found: {static}")
    return settings


def cmd_serve(args: argparse.Namespace) -> int:
    import torch
    import uvicorn

    from specserve.server import listen
    from specserve.server.app import create_app
    from specserve.server.lifecycle import GracefulServer
    from specserve.server.model_router import end_with_parent

    end_with_parent()  # (a model's server under a router)
    if args.models_dir is not None or args.models_preset is not None:
        from specserve.cli.serve_router import run_router

        return run_router(args, api_keys(args))
    settings = server_settings(args)
    keys = api_keys(args)  # (an unreadable key file is a one-line error before anything binds)
    hosts = listen.parse_hosts(args.host)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("specserve").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    sockets = listen.bind(hosts, args.port)  # now: a bad address is an error before the model loads
    failures: list[str] = []
    server: uvicorn.Server | None = None

    def on_load_error(message: str) -> None:
        failures.append(message)
        if server is not None:
            server.should_exit = True

    app = create_app(settings, keys, on_load_error=on_load_error)
    config = listen.uvicorn_config(app, hosts[0], args.port)
    server = GracefulServer(config, app.state.server.admission, args.shutdown_grace)
    print(f"specserve: starting on {', '.join(listen.urls(hosts, args.port))} — loading "
          f"{args.model or 'the default model'} (GET /health says 503 until ready)", file=sys.stderr, flush=True)
    server.run(sockets=sockets)
    if failures:
        raise SpecserveError(f"could not load the model: {failures[0]}")
    return 0
