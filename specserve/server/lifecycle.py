"""Graceful shutdown: on SIGTERM (or Ctrl+C) stop admitting, let running requests finish for a grace
period, then end the rest with a proper final event, and exit 0.

uvicorn's own handling stops listening at once (new clients see connection refused), cuts every open
stream when its timeout passes (clients get a truncated chunked body) and re-raises the signal, so
the process dies of it. Here the first signal starts a drain: the socket stays open and every new
request gets 503 with Retry-After; generation requests still running are waited for; when the grace
period is over each is ended through its event queue (streams send an error event, then `[DONE]` for
OpenAI's; others answer 503); then uvicorn shuts down with nothing left to cut. A second signal ends
the grace period at once, a third exits without waiting.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from types import FrameType

import uvicorn

from specserve.server.limits import SHUTTING_DOWN, Admission

log = logging.getLogger(__name__)

_POLL_S = 0.05
_FLUSH_S = 5.0  # for ended requests to send their last event


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, admission: Admission, grace_s: float):
        super().__init__(config)
        self.admission = admission
        self.grace_s = grace_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._n_signals = 0
        self._hurry = False
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the main thread (the event loop's) between bytecodes: only set flags and schedule.
        self._n_signals += 1
        if self._loop is None or self._n_signals > 2:
            self.should_exit = self.force_exit = True
        elif self._n_signals == 1:
            log.info("%s: shutting down", signal.Signals(sig).name)
            self._loop.call_soon_threadsafe(self._start_drain)
        else:
            self._hurry = True

    def _start_drain(self) -> None:
        self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _wait_idle(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.admission.active and not self._hurry and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)

    async def _drain(self) -> None:
        admission = self.admission
        admission.draining = True
        if admission.active:
            log.info("refusing new requests; waiting up to %.0f s for %d running", self.grace_s,
                     len(admission.active))
            await self._wait_idle(self.grace_s)
        if admission.active:
            log.warning("shutdown grace period over: ending %d requests", admission.interrupt_all(SHUTTING_DOWN))
            self._hurry = False
            await self._wait_idle(_FLUSH_S)
        self.should_exit = True
