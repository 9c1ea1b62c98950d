"""One log line per request: method, path, status, tokens, milliseconds (logger `specserve.server.requests`).

Pure ASGI, outermost, so that answers given before any route (401, 413, 503, CORS preflights) are logged
too and a stream is logged when its last event went out. A generation route leaves its Result where the
line can read it (`note_result`). Successful health checks log at DEBUG: load balancers poll them.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from specserve.engine.tasks import Result
from specserve.server.middleware import HttpMiddleware

log = logging.getLogger("specserve.server.requests")

_KEY = "specserve.result"
_HEALTH = {"/health", "/v1/health"}


def note_result(scope: Scope, result: Result) -> None:
    """Called by a route when its task finished: the line reports its tokens."""
    scope[_KEY] = result


def format_line(method: str, path: str, status: int, ms: float, result: Result | None) -> str:
    tokens = ""
    if result is not None:
        tokens = f" tokens={result.n_prompt}+{result.n_predicted} cached={result.n_cached}"
    return f"{method} {path} {status}{tokens} {ms:.1f} ms"


class RequestLogMiddleware(HttpMiddleware):
    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        t0 = time.perf_counter()
        status = 0

        async def send_noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            # 499 (nginx's): the client went away before any answer
            status = status or 499
            path: Any = scope.get("path", "")
            level = logging.DEBUG if path in _HEALTH and status == 200 else logging.INFO
            if log.isEnabledFor(level):
                log.log(level, "%s", format_line(scope["method"], path, status, (time.perf_counter() - t0) * 1000,
                                                 scope.get(_KEY)))
