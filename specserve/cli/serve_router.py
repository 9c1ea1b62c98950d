"""`specserve serve --models-dir DIR`: router mode (server/model_router.py). The router takes the address, the API
keys and the model choice; every other flag it was given goes to each model's own server."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from specserve.cli.model_presets import ModelPreset, read_presets
from specserve.cli.serve_flags import comma_list
from specserve.errors import SpecserveError
from specserve.server.model_router import ModelEntry

# the router's own flags (with a value, or without), never passed to a model's server
ROUTER_VALUED = {"--models-dir", "--models-max", "--models-preset", "--host", "--port", "--api-key", "--api-key-file",
                 "-m", "--model", "-a", "--alias"}
ROUTER_FLAGS = {"--models-autoload", "--no-models-autoload"}


def add_router_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--models-dir", type=Path, default=None, metavar="DIR",
                   help="router mode: serve the GGUF files in DIR (and the installed catalog models), each in a "
                        "server process of its own loaded on first use; requests choose one by `model`")
    g.add_argument("--models-preset", type=Path, default=None, metavar="FILE",
                   help="router mode: llama-server's INI presets, a section per model ([*]: all) of serve flags "
                        "without dashes, and load-on-startup / stop-timeout")
    g.add_argument("--models-max", type=int, default=4, metavar="N",
                   help="router mode: models loaded at once; loading one more unloads the least recently used "
                        "(default 4, 0: no limit)")
    g.add_argument("--models-autoload", dest="models_autoload", action="store_true", default=True,
                   help="router mode: load a model when a request names it (the default)")
    g.add_argument("--no-models-autoload", dest="models_autoload", action="store_false",
                   help="router mode: only POST /models/load loads (a request's ?autoload=true still does)")


def child_args(argv: list[str]) -> list[str]:
    """The flags of `serve` as given, less the router's own: what every model's server gets."""
    args = argv[1:] if argv and argv[0] == "serve" else list(argv)
    out: list[str] = []
    i = 0
    while i < len(args):
        flag = args[i].split("=", 1)[0]
        if flag in ROUTER_VALUED:
            i += 1 if "=" in args[i] else 2
            continue
        if flag not in ROUTER_FLAGS:
            out.append(args[i])
        i += 1
    return out


def serve_flags(serve: argparse.ArgumentParser) -> tuple[argparse.ArgumentParser, dict[str, argparse.Action]]:
    """The serve command's parser, and its actions by environment variable."""
    from specserve.cli.serve_flags import env_name

    return serve, {name: a for a in serve._actions if (name := env_name(a)) is not None}


def apply_presets(models: dict[str, ModelEntry], presets: dict[str, ModelPreset]) -> list[str]:
    """Each model's preset flags ([*] first, then its own section) and stop timeout; sections with `model = PATH`
    add models. Returns the models to load at start."""
    common = presets.get("*", ModelPreset())
    for name, preset in presets.items():
        if name == "*" or name in models:
            continue
        if preset.path is None:
            raise SpecserveError(f"--models-preset [{name}]: no such model here; give it `model = PATH`")
        if not preset.path.is_file():
            raise SpecserveError(f"--models-preset [{name}]: model file not found: {preset.path}")
        models[name] = ModelEntry(name, preset.path.resolve())
    for name, entry in models.items():
        own = presets.get(name, ModelPreset())
        entry.preset_args = [*common.args, *own.args]
        entry.stop_timeout = own.stop_timeout or common.stop_timeout or entry.stop_timeout
    return [name for name in models if presets.get(name, common).load_on_startup]


def run_router(args: argparse.Namespace, api_keys: str | None) -> int:
    import uvicorn

    from specserve.server import listen
    from specserve.server.model_router import ModelInstances, find_models
    from specserve.server.router_app import create_router_app

    if args.model:
        raise SpecserveError("-m and --models-dir: one model, or a router over a folder; not both")
    if args.models_max < 0:
        raise SpecserveError(f"--models-max must be 0 (no limit) or more, got {args.models_max}")
    models = find_models(args.models_dir)
    presets = read_presets(args.models_preset, *serve_flags(args.serve_parser)) if args.models_preset else {}
    startup = apply_presets(models, presets)
    if not models:
        raise SpecserveError(f"--models-dir {args.models_dir}: no GGUF files (and no installed catalog models)")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("specserve").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    hosts = listen.parse_hosts(args.host)
    sockets = listen.bind(hosts, args.port)
    # the router's env vars are not its models' (a model's server given LLAMA_ARG_MODELS_DIR would route again)
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("LLAMA_ARG_MODELS_") or k in ("LLAMA_ARG_MODEL", "LLAMA_ARG_ALIAS"))}
    instances = ModelInstances(models, child_args(args.argv), args.models_max, args.models_autoload, env)
    instances.load_at_start = startup
    app = create_router_app(instances, comma_list(api_keys), webui_on=args.webui,
                            cors_origins=comma_list(args.cors_origins))
    config = listen.uvicorn_config(app, hosts[0], args.port)
    print(f"specserve: router on {', '.join(listen.urls(hosts, args.port))} over {len(models)} model(s): "
          f"{', '.join(models)}", file=sys.stderr, flush=True)
    uvicorn.Server(config).run(sockets=sockets)
    return 0
