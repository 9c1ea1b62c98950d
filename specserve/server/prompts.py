"""Prompts and token references in requests, read as llama-server reads them (call from a worker thread:
tokenizing is CPU-heavy).

`prompt` forms: a string, a list of token ids, or a list mixing ids and strings is ONE prompt; a list of
strings, or of such lists, is a batch (one task per prompt). In a mixed list only a string in the first
place gets the model's bos, as llama-server's tokenize_mixed adds it.
"""

from __future__ import annotations

import math

from specserve.errors import SpecserveError
from specserve.server.tokenizing import TextEncoder

PromptPart = int | str
OnePrompt = str | list[PromptPart]
PromptInput = str | list[PromptPart | list[PromptPart]]
# Pairs are lists, checked here: the request models validate in Python mode, where a strict tuple refuses them.
LogitBiasInput = list[list[int | str | float | bool]] | dict[str, float | bool]


def split_prompts(prompt: PromptInput) -> list[OnePrompt]:
    """The prompts of a request (one, or a batch), by llama-server's rule."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise SpecserveError("the prompt is empty")
    if any(isinstance(p, list) for p in prompt):
        if any(isinstance(p, int) for p in prompt):
            raise SpecserveError("prompt: a batch of prompts holds strings or lists, not bare token ids")
        return list(prompt)  # type: ignore[arg-type]
    if any(isinstance(p, int) for p in prompt):
        return [prompt]  # type: ignore[list-item]  # token ids, maybe mixed with strings: one prompt
    return list(prompt)  # type: ignore[arg-type]  # strings: a batch


def check_ids(ids: list[int], vocab_size: int, what: str = "prompt token id") -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise SpecserveError(f"{what} {bad[0]} is out of range (vocabulary has {vocab_size} tokens)")


def tokenize_one(encoder: TextEncoder, prompt: OnePrompt, add_special: bool = True,
                 parse_special: bool = True) -> list[int]:
    """One prompt's ids. Text parses control tokens by default: a raw prompt is the caller's own, template
    and all."""
    if isinstance(prompt, str):
        return encoder.encode(prompt, add_special=add_special, parse_special=parse_special)
    ids: list[int] = []
    for i, part in enumerate(prompt):
        if isinstance(part, str):
            ids += encoder.encode(part, add_special=add_special and i == 0, parse_special=parse_special)
        else:
            ids.append(part)
    check_ids(ids, encoder.tokenizer.vocab_size)
    return ids


def resolve_logit_bias(encoder: TextEncoder, given: LogitBiasInput) -> dict[int, float]:
    """llama-server's forms: [[token id or text, bias], ...] or {"token id or text": bias}; a bias of false
    means never. Text stands for each of its tokens; amounts for one token add up."""
    pairs = list(given.items()) if isinstance(given, dict) else given
    out: dict[int, float] = {}
    vocab = encoder.tokenizer.vocab_size
    for pair in pairs:
        if len(pair) != 2 or isinstance(pair[0], bool | float) or isinstance(pair[1], str):
            raise SpecserveError(f"logit_bias: each entry is [token id or text, bias], got {list(pair)!r}")
        key, bias = pair[0], pair[1]  # (as checked above)
        if bias is True or (not isinstance(bias, bool) and not math.isfinite(bias)):
            raise SpecserveError(f"logit_bias: a bias is a finite number, or false for never (got {bias!r})")
        amount = -math.inf if bias is False else float(bias)
        if isinstance(key, str) and isinstance(given, dict) and key.lstrip("-").isdigit():
            key = int(key)  # OpenAI's map keys are token ids as strings
        if isinstance(key, int):
            check_ids([key], vocab, "logit_bias token id")
            ids = [key]
        else:
            ids = encoder.encode(key, add_special=False, parse_special=False)
        for t in ids:
            out[t] = out.get(t, 0.0) + amount
    return out
