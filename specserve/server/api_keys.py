"""Which of the server's API keys a request gives: `Authorization: Bearer KEY` or `x-api-key: KEY` (Anthropic's
clients), compared in constant time against every key."""

from __future__ import annotations

import hmac
from collections.abc import Mapping


def key_index(headers: Mapping[str, str], keys: list[str]) -> int | None:
    """The index of the key the request gives (headers by lower-case name); None: none of them."""
    given = headers.get("x-api-key") or ""
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        given = auth[7:].strip()
    matches = [hmac.compare_digest(given.encode(), key.encode()) for key in keys]  # (each compared)
    return matches.index(True) if given and any(matches) else None
