"""Where `specserve serve` listens: llama-server's `--host`, one address or several, comma-separated, and a
name ending in `.sock` for a UNIX socket.

The sockets are bound here, before the model loads, so an address that cannot be used is one line at
start-up. Several TCP addresses each get their own socket; an IPv6 one (e.g. `::`) then binds IPv6 only,
as in llama-server.
"""

from __future__ import annotations

import os
import socket
import stat
from typing import Any

import uvicorn

from specserve.errors import SpecserveError


def parse_hosts(value: str) -> list[str]:
    hosts = [h.strip() for h in value.split(",")]
    if not value.strip() or any(not h for h in hosts):
        raise SpecserveError(f"--host {value!r}: give an address, or several separated by commas")
    if len(set(hosts)) != len(hosts):
        raise SpecserveError(f"--host {value!r} names an address twice")
    return hosts


def _bind_unix(path: str) -> socket.socket:
    try:
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)  # a stale socket of an earlier run; any other file is left alone (bind fails)
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen()  # as create_server's TCP sockets: connections queue from now on
    except OSError:
        sock.close()
        raise
    return sock


def _bind_tcp(host: str, port: int) -> socket.socket:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    sock = socket.create_server((host, port), family=family)  # (IPv6: IPV6_V6ONLY set, as llama-server)
    # Connections inherit it (Linux): a response's header and body writes then go out at once; with Nagle
    # the body waited for the client's delayed ACK, ~40 ms on every keep-alive request.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def bind(hosts: list[str], port: int) -> list[socket.socket]:
    """One listening socket per host; SpecserveError (the others closed) if any cannot be bound."""
    sockets: list[socket.socket] = []
    for host in hosts:
        try:
            sockets.append(_bind_unix(host) if host.endswith(".sock") else _bind_tcp(host, port))
        except (OSError, UnicodeError) as exc:
            for s in sockets:
                s.close()
            where = host if host.endswith(".sock") else f"{host} port {port}"
            errno = exc.errno if isinstance(exc, OSError) else None
            reason = os.strerror(errno) if errno and errno > 0 else str(exc)  # (create_server adds the address)
            raise SpecserveError(f"cannot listen on {where}: {reason}") from None
    return sockets


def urls(hosts: list[str], port: int) -> list[str]:
    return [f"unix:{h}" if h.endswith(".sock") else f"http://{f'[{h}]' if ':' in h else h}:{port}" for h in hosts]


def uvicorn_config(app: Any, host: str, port: int) -> uvicorn.Config:
    """The server's uvicorn settings (the one-model server's and the router's). asyncio's own loop even where uvloop
    is installed (the GPU image has it): it measured no gain over httptools alone (docs/perf.md), and one loop
    everywhere keeps the server's behaviour alike across machines."""
    return uvicorn.Config(app, host=host, port=port, log_level="info", access_log=False, timeout_graceful_shutdown=5,
                          loop="asyncio")
