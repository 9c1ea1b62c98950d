"""Render a GGUF chat template (jinja2) the way HF transformers does, in a sandbox.

The environment matches HF's `apply_chat_template` (trim_blocks, lstrip_blocks, loop
controls, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text), so
prompts are byte-identical to what the model saw in training.

Undefined values are lenient, as the seed's llama.cpp `common/jinja` changes ask: a
`for` over an undefined value runs its `else` branch, `undefined is iterable` and
`is sequence` are true, filters on undefined give empty results (`length`, `wordcount`,
`sum` -> 0; `list`, `sort` -> []; string filters, `join`, `first`, `last`, `min`, `max`
-> empty), and `none|safe` is "None". jinja2's own `Undefined` already behaves so (the
tests pin every case); we use `ChainableUndefined` so that reading a field of a missing
value (`message.tool_calls.0.name`) is undefined too instead of failing the request.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from specserve.errors import SpecserveError

if TYPE_CHECKING:
    from specserve.gguf.tokenizer import Tokenizer


def _raise_exception(message: str) -> None:
    # templates call this to reject a conversation they cannot render (e.g. bad role order)
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _json_default(value: Any) -> Any:
    if isinstance(value, jinja2.Undefined):
        return None
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF's version: plain json.dumps, no HTML escaping (jinja's built-in turns '<' into \u003c)
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
        default=_json_default,
    )


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols],
        undefined=jinja2.ChainableUndefined,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _make_environment()


@lru_cache(maxsize=64)
def _compile(template: str) -> jinja2.Template:
    try:
        return _ENV.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise SpecserveError(f"chat template syntax error at line {exc.lineno}: {exc.message}") from None
    except jinja2.TemplateError as exc:
        raise SpecserveError(f"chat template cannot be compiled: {exc}") from None


def check_template(template: str) -> None:
    """Compile template; SpecserveError naming the problem if it is not valid Jinja."""
    _compile(template)


def render_chat(
    template: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    tools: list | None = None,
    **extra: Any,
) -> str:
    """The prompt text `template` makes of `messages` (extra keywords become template variables)."""
    if not isinstance(template, str) or not template:
        raise SpecserveError("chat template is empty")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise SpecserveError("messages must be a list of objects")
    compiled = _compile(template)
    variables = {
        **extra,
        "messages": messages,
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token,
        "eos_token": eos_token,
        "tools": tools,
    }
    try:
        return compiled.render(**variables)
    except jinja2.TemplateError as exc:  # raise_exception, undefined errors, sandbox violations
        raise SpecserveError(f"chat template error: {exc.message or exc}") from None
    except Exception as exc:  # e.g. `'text' + none` in the template: the conversation does not fit it
        raise SpecserveError(f"chat template failed on these messages: {type(exc).__name__}: {exc}") from None


def apply_chat_template(
    tokenizer: Tokenizer, messages: list[dict], add_generation_prompt: bool = True, **extra: Any
) -> str:
    """Render `messages` with the model's own template (`tokenizer.chat_template`)."""
    if tokenizer.chat_template is None:
        raise SpecserveError(
            "this model has no chat template (tokenizer.chat_template); send a raw prompt to /completion instead"
        )
    if tokenizer.bos_id is not None:
        extra.setdefault("bos_token", tokenizer.token_text(tokenizer.bos_id))
    if tokenizer.eos_id is not None:
        extra.setdefault("eos_token", tokenizer.token_text(tokenizer.eos_id))
    return render_chat(tokenizer.chat_template, messages, add_generation_prompt=add_generation_prompt, **extra)
