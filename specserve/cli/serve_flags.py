"""llama-server's serve flags beyond the model, sampling and limits ones: how the GGUF is read, the KV
layout, chat templates, which endpoints exist, model names and tags. What each means here, where it differs
from llama-server, is in docs/compatibility.md ("Server flags")."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from specserve.errors import SpecserveError
from specserve.gguf.template_names import BUILTIN_TEMPLATES, resolve_chat_template
from specserve.server.reasoning import FORMATS as REASONING_FORMATS

log = logging.getLogger(__name__)

# Environment values llama-server takes for a boolean flag.
_TRUE, _FALSE = {"1", "true", "on", "enabled"}, {"0", "false", "off", "disabled"}


# llama-server's env names where they differ from LLAMA_ARG_<first long flag>.
_ENV_OVERRIDES = {"parallel": "LLAMA_ARG_N_PARALLEL", "api_key": "LLAMA_API_KEY", "batch_size": "LLAMA_ARG_BATCH",
                  "direct_io": "LLAMA_ARG_DIO", "endpoint_slots": "LLAMA_ARG_ENDPOINT_SLOTS",
                  "endpoint_metrics": "LLAMA_ARG_ENDPOINT_METRICS", "reasoning_format": "LLAMA_ARG_THINK",
                  "reasoning_budget": "LLAMA_ARG_THINK_BUDGET",
                  "cache_type_k_draft": "LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_K",
                  "cache_type_v_draft": "LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_V"}
_NO_ENV = {"spec_replace", "lora"}  # two values a use, or a list of files: no env var, as in llama-server


def env_name(action: argparse.Action) -> str | None:
    # A flag's negation (--no-mmap) shares its dest and env var with the flag (_pair below).
    if action.dest in _NO_ENV or isinstance(action, argparse._StoreFalseAction):
        return None
    if action.dest in _ENV_OVERRIDES:
        return _ENV_OVERRIDES[action.dest]
    longs = [o for o in action.option_strings if o.startswith("--")]
    if not longs or action.dest == "help":
        return None
    return "LLAMA_ARG_" + longs[0][2:].upper().replace("-", "_")


def comma_list(text: str | None) -> list[str]:
    """The items of a comma-separated flag value, stripped, empty ones left out."""
    return [item.strip() for item in (text or "").split(",") if item.strip()]


def parse_bool(name: str, value: str) -> bool:
    """A boolean as llama-server reads one from its environment (and its presets)."""
    low = value.strip().lower()
    if low in _TRUE | _FALSE:
        return low in _TRUE
    raise SpecserveError(f"{name}={value!r} is not a boolean (true/false, 1/0, on/off, enabled/disabled)")


def _pair(g: argparse._ArgumentGroup, on: list[str], off: list[str], dest: str, default: bool, help: str) -> None:
    """A flag and its negation on one dest, as llama-server's `--x, --no-x` (the env var goes with `on`)."""
    g.add_argument(*on, dest=dest, action="store_true", default=default, help=help)
    g.add_argument(*off, dest=dest, action="store_false", help=argparse.SUPPRESS)


class LoraFiles(argparse.Action):
    """--lora FNAME[,FNAME...] (scale 1) and --lora-scaled FNAME:SCALE[,...] into one list, in the order given
    (an adapter's id is its place in it, as llama-server numbers them)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option: str | None = None) -> None:
        files: list[tuple[str, float]] = list(getattr(namespace, self.dest) or [])
        for item in str(values).split(","):
            path, scale = item, 1.0
            if option == "--lora-scaled":
                path, _, text = item.rpartition(":")
                try:
                    scale = float(text)
                except ValueError:
                    raise argparse.ArgumentError(self, f"{item!r} is not FNAME:SCALE") from None
            if not path:
                raise argparse.ArgumentError(self, f"{item!r} names no file")
            files.append((path, scale))
        setattr(namespace, self.dest, files)


def add_llama_server_flags(g: argparse._ArgumentGroup) -> None:
    _pair(g, ["--mmap"], ["--no-mmap"], "mmap", True,
          "read the GGUF through a memory map (default); --no-mmap reads its tensors into memory first")
    _pair(g, ["-dio", "--direct-io"], ["-ndio", "--no-direct-io"], "direct_io", False,
          "accepted: reads the GGUF into memory as --no-mmap (no O_DIRECT here)")
    _pair(g, ["-kvu", "--kv-unified"], ["-no-kvu", "--no-kv-unified"], "kv_unified", False,
          "accepted: the KV cache is always one pool of -c positions that every slot draws from")
    _pair(g, ["--context-shift"], ["--no-context-shift"], "context_shift", False,
          "a generation that fills its context drops the older half of its tokens after n_keep and goes on "
          "(default off: it ends, stop_type limit)")
    _pair(g, ["--slots"], ["--no-slots"], "endpoint_slots", True, "GET /slots (default on; --no-slots: 501)")
    _pair(g, ["--webui"], ["--no-webui", "--no-ui"], "webui", True,
          "serve the chat page at / (default on; --no-webui: the API alone)")
    _pair(g, ["--metrics"], ["--no-metrics"], "endpoint_metrics", False,
          "GET /metrics, Prometheus-style (default off, as llama-server: 501)")
    _pair(g, ["--jinja"], ["--no-jinja"], "jinja", True, "accepted: chat templates are always Jinja here")
    g.add_argument("--chat-template", default=None, metavar="NAME|JINJA",
                   help=f"chat template instead of the GGUF's: a name ({', '.join(BUILTIN_TEMPLATES)}) or Jinja text")
    g.add_argument("--chat-template-file", default=None, metavar="FILE", help="read the chat template from FILE")
    g.add_argument("--reasoning-format", choices=REASONING_FORMATS, default="auto",
                   help="chat answers: none keeps a <think> block in content; deepseek and auto (the default) give "
                        "it as message.reasoning_content (a request's reasoning_format overrides it)")
    g.add_argument("--reasoning-budget", type=int, default=-1, metavar="N",
                   help="-1: unlimited thinking (the default); 0: thinking off (the chat template gets "
                        "enable_thinking=false); no other budget is supported")
    g.add_argument("--spec-replace", nargs=2, action="append", default=[], metavar=("TARGET", "DRAFT"),
                   help="accepted: no effect, as a draft model must share the target's vocabulary here")
    g.add_argument("--tags", default=None, help="model tags, comma-separated (informational: /v1/models)")
    g.add_argument("--lora", action=LoraFiles, dest="lora", default=[], metavar="FNAME",
                   help="a LoRA adapter (llama.cpp's GGUF adapter file) at scale 1; repeat or comma-separate")
    g.add_argument("--lora-scaled", action=LoraFiles, dest="lora", metavar="FNAME:SCALE",
                   help="a LoRA adapter at a scale of its own; repeat or comma-separate")
    g.add_argument("-cram", "--cache-ram", type=int, default=None, metavar="MiB",
                   help="host memory for prompt caches the KV pool gives up, read back for prompts that start with "
                        "them (-1: no limit, 0: off; default 8192 on a GPU, off on the CPU)")
    g.add_argument("--sleep-idle-seconds", type=float, default=-1, metavar="SECONDS",
                   help="after SECONDS without work, let the model and its KV go and load them again for the next "
                        "request (/props is_sleeping; default -1: never)")
    g.add_argument("--lora-init-without-apply", action="store_true",
                   help="load the adapters at scale 0 (POST /lora-adapters or a request's lora field applies them)")


def llama_server_settings(args: argparse.Namespace) -> dict[str, Any]:
    """ServerSettings fields from these flags; SpecserveError for a value that cannot work."""
    if args.spec_replace:
        log.warning("--spec-replace has no effect: the draft model must share the target's vocabulary, so no "
                    "text is translated between them")
    tags = [t.strip() for t in (args.tags or "").split(",") if t.strip()]
    return {"mmap": args.mmap and not args.direct_io, "endpoint_slots": args.endpoint_slots,
            "endpoint_metrics": args.endpoint_metrics, "context_shift": args.context_shift, "webui": args.webui,
            "tags": tags, "sleep_idle_seconds": args.sleep_idle_seconds, "cache_ram": args.cache_ram,
            "lora": [(path, 0.0 if args.lora_init_without_apply else scale) for path, scale in args.lora],
            "chat_template": resolve_chat_template(args.chat_template, args.chat_template_file),
            "reasoning_format": args.reasoning_format, "reasoning_budget": args.reasoning_budget}
