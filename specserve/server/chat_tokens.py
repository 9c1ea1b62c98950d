"""Control tokens in a chat prompt come from the chat template only.

Text a request sends inside `messages` or `tools` that spells a control token (e.g. `<|im_end|>`
in a user message) is tokenized as the characters it is, so a user cannot close their turn and
write a system turn of their own. The strings are masked with placeholders before the template
runs, the template's output is split at the control tokens it wrote, and each piece between them
is tokenized as plain text with the masked strings put back.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from typing import Any

from specserve.server.tokenizing import TextEncoder


def _map_strings(value: Any, fn: Callable[[str], str]) -> Any:
    """value with fn applied to every string in it (dict keys left alone)."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, list):
        return [_map_strings(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: _map_strings(v, fn) for k, v in value.items()}
    return value


class ControlTokens:
    """The tokenizer's control tokens as text, and the template-only rule for chat prompts."""

    def __init__(self, encoder: TextEncoder):
        self.encoder = encoder
        tok = encoder.tokenizer
        self.ids: dict[str, int] = {}
        for i in range(tok.vocab_size):
            if tok.is_special(i):
                text = tok.token_text(i)
                parsed = tok.encode(text, add_special=False, parse_special=True)
                if len(parsed) == 1:  # a repeated text: the id the tokenizer itself gives it
                    self.ids[text] = parsed[0]
        # Longest first, so that at one position the longest control token wins, as the tokenizer's matching.
        alternatives = "|".join(re.escape(t) for t in sorted(self.ids, key=len, reverse=True))
        self.pattern = re.compile(f"({alternatives})") if self.ids else None

    def found_in(self, value: Any) -> bool:
        """Whether any string in value spells a control token."""
        found = False

        def check(text: str) -> str:
            nonlocal found
            found = found or (self.pattern is not None and self.pattern.search(text) is not None)
            return text

        _map_strings(value, check)
        return found

    def mask(self, value: Any) -> tuple[Any, dict[str, str]]:
        """value with every control-token text replaced by a placeholder, and placeholder -> text.

        Placeholders are private-use characters around a random number (digits survive a template's
        upper/lower/trim filters); a request cannot predict them to forge one."""
        assert self.pattern is not None
        nonce = secrets.randbelow(10**12)
        placeholders: dict[str, str] = {}
        by_text: dict[str, str] = {}

        def placeholder(m: re.Match[str]) -> str:
            text = m.group(0)
            if text not in by_text:
                by_text[text] = f"\ue000{nonce}_{len(by_text)}\ue001"
                placeholders[by_text[text]] = text
            return by_text[text]

        pattern = self.pattern
        return _map_strings(value, lambda s: pattern.sub(placeholder, s)), placeholders

    def encode_rendered(self, rendered: str, placeholders: dict[str, str]) -> list[int]:
        """Tokens of a template's output rendered from masked strings: control tokens where the template
        wrote them, the rest (the masked strings put back) as plain text."""
        assert self.pattern is not None
        restore = re.compile("|".join(re.escape(p) for p in placeholders)) if placeholders else None
        ids: list[int] = []
        # split with one group: text, control token, text, ..., text
        for i, part in enumerate(self.pattern.split(rendered)):
            if i % 2:
                ids.append(self.ids[part])
                continue
            if restore is not None:
                part = restore.sub(lambda m: placeholders[m.group(0)], part)
            if part:
                ids += self.encoder.encode(part, add_special=False, parse_special=False)
        return ids
