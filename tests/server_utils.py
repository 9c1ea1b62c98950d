"""Start a real `specserve serve` process on a free port and talk to it over HTTP."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m specserve.cli serve ARGS --port <free>`; stop() kills only this process."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, port: int | None = None,
                 api_key: str | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = Path(tempfile.mkstemp(prefix="specserve-server-", suffix=".log")[1])
        cmd = [sys.executable, "-m", "specserve.cli", "serve", *args]
        if port is None:
            cmd += ["--port", str(self.port)]
        # Passive OpenMP waits: spinning torch threads collapse when the CPU is shared (a busy CI box).
        full_env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ, **(env or {})}
        self._log = open(self.log_path, "w")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=self._log, stderr=subprocess.STDOUT)
        self.health_seen: list[tuple[int, Any]] = []  # (status, body) of each /health answer while waiting

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 180.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(self.url + "/health", timeout=5)
                body = r.json()
                if not self.health_seen or self.health_seen[-1] != (r.status_code, body):
                    self.health_seen.append((r.status_code, body))
                if r.status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()

    # -- HTTP helpers -------------------------------------------------------------------------------

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers(), timeout=kw.pop("timeout", 120), **kw)

    def post(self, path: str, body: Any = None, *, content: bytes | None = None, **kw: Any) -> httpx.Response:
        headers = {**self.headers(), "Content-Type": "application/json", **kw.pop("headers", {})}
        data = content if content is not None else json.dumps(body).encode()
        return httpx.post(self.url + path, content=data, headers=headers, timeout=kw.pop("timeout", 120), **kw)

    def stream(self, path: str, body: Any, timeout: float = 120) -> Iterator[Any]:
        """The decoded `data:` events of an SSE answer ('[DONE]' as the string itself)."""
        with httpx.stream("POST", self.url + path, json=body, headers=self.headers(), timeout=timeout) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    yield data if data == "[DONE]" else json.loads(data)

    def complete(self, prompt: str | list[int], n_predict: int = 16, **fields: Any) -> dict[str, Any]:
        body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0, **fields}
        r = self.post("/completion", body)
        assert r.status_code == 200, r.text
        return r.json()

    def wait_slots_idle(self, timeout: float = 10.0) -> float:
        """Seconds until /slots shows no slot processing; raises on timeout."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if not any(s["is_processing"] for s in self.get("/slots").json()):
                return time.monotonic() - t0
            time.sleep(0.02)
        raise TimeoutError(f"slots still busy after {timeout}s: {self.get('/slots').json()}")


def served(*args: str, **kw: Any) -> Iterator[ServerProcess]:
    """A module fixture's body: the server started and ready, stopped after the module."""
    srv = ServerProcess(*args, **kw)
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()
