"""`--models-preset FILE`: llama-server's INI presets for router mode. A section per model (`[*]`: every model)
whose keys are `serve` flags without their dashes (`c`, `ctx-size`, `chat-template`), or their environment
variables (`LLAMA_ARG_CTX_SIZE`); `true`/`false` for switches. A section naming no known model adds one and must
say `model = PATH`. Router-only keys: `load-on-startup` (true: loaded when the router starts) and `stop-timeout`
(seconds an unloaded model's server has to drain). The command line wins over a model's section, which wins over
`[*]`."""

from __future__ import annotations

import argparse
import configparser
from dataclasses import dataclass, field
from pathlib import Path

from specserve.cli.serve_flags import parse_bool
from specserve.errors import SpecserveError

ROUTER_KEYS = ("load-on-startup", "stop-timeout", "model")
NOT_IN_PRESETS = {"--host", "--port", "--api-key", "--api-key-file", "--models-dir", "--models-max",
                  "--models-preset", "--models-autoload", "--no-models-autoload", "--alias"}


@dataclass
class ModelPreset:
    args: list[str] = field(default_factory=list)  # serve flags, in the order they apply
    path: Path | None = None  # `model = PATH`
    load_on_startup: bool = False
    stop_timeout: float | None = None


def _flag_for(key: str, parser: argparse.ArgumentParser, env_of: dict[str, argparse.Action]) -> argparse.Action:
    if key in env_of:
        return env_of[key]
    for option in (f"--{key}", f"-{key}"):
        for action in parser._actions:
            if option in action.option_strings:
                return action
    raise SpecserveError(f"--models-preset: '{key}' is not a serve flag")


def _section_args(section: configparser.SectionProxy, parser: argparse.ArgumentParser,
                  env_of: dict[str, argparse.Action]) -> list[str]:
    out: list[str] = []
    for key, value in section.items():
        if key in ROUTER_KEYS:
            continue
        action = _flag_for(key, parser, env_of)
        option = next(o for o in action.option_strings if o.startswith("--") or len(action.option_strings) == 1)
        if option in NOT_IN_PRESETS or action.dest in ("model", "help"):
            raise SpecserveError(f"--models-preset: '{key}' is the router's own, not a model's")
        if action.nargs == 0:  # a switch: its flag, or its negation (a --no-... twin sharing its dest)
            if parse_bool(f"--models-preset: {key}", value):
                out.append(option)
            else:
                twin = next((o for a in parser._actions if a.dest == action.dest and a is not action
                             for o in a.option_strings if o.startswith("--")), None)
                if twin is None:
                    raise SpecserveError(f"--models-preset: '{key}' cannot be set false")
                out.append(twin)
        else:
            out += [option, value]
    return out


def read_presets(path: Path, parser: argparse.ArgumentParser,
                 env_of: dict[str, argparse.Action]) -> dict[str, ModelPreset]:
    """Each section's preset ("*" for the global one); a one-line error for an unreadable file or a bad key."""
    ini = configparser.ConfigParser(interpolation=None, default_section="__none__")
    ini.optionxform = str  # type: ignore[assignment,method-assign]  # keys keep their case (env var names)
    try:
        # keys before the first section (llama-server's `version = 1`) go to a section of their own, unread
        ini.read_string("[__top__]\n" + path.read_text(encoding="utf-8"), source=str(path))
    except (OSError, configparser.Error, UnicodeDecodeError) as exc:
        raise SpecserveError(f"--models-preset {path}: {exc}") from None
    presets: dict[str, ModelPreset] = {}
    for name in ini.sections()[1:]:
        section = ini[name]
        preset = ModelPreset(_section_args(section, parser, env_of))
        if "model" in section:
            preset.path = Path(section["model"]).expanduser()
        preset.load_on_startup = parse_bool(f"--models-preset [{name}]: load-on-startup",
                                            section.get("load-on-startup", "false"))
        if "stop-timeout" in section:
            try:
                preset.stop_timeout = float(section["stop-timeout"])
            except ValueError:
                raise SpecserveError(f"--models-preset [{name}]: stop-timeout takes seconds") from None
        presets[name] = preset
    return presets
