"""Router mode (`serve --models-dir DIR`): the models a server may serve and the process each loaded one runs in.

As llama-server's router, every loaded model is a `specserve serve` of its own on a private port, started on
first use (or `POST /models/load`) and stopped on `POST /models/unload` or when a load would pass `--models-max`
(the least recently used goes first): a model that fails or crashes takes no other down, and each has its own
scheduler, KV pool and engine core. Requests that arrive while their model loads wait for it."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from specserve import catalog
from specserve.errors import SpecserveError
from specserve.gguf.reader import GGUFFile

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)
PARENT_ENV = "SPECSERVE_ROUTER_PID"  # set for a model's server: the router it must not outlive
STOP_TIMEOUT = 10.0  # seconds a stopped model's process has to drain before it is killed


@dataclass
class ModelEntry:
    """One model the router knows: where its file is and, while loaded, its process."""

    id: str
    path: Path
    status: str = "unloaded"  # unloaded, loading, loaded
    proc: subprocess.Popen | None = None
    url: str = ""
    key: str = ""  # the private API key of its process
    args: list[str] = field(default_factory=list)
    last_used: float = 0.0
    failed: bool = False
    exit_code: int | None = None
    ready: asyncio.Event | None = None  # set when a load ends, loaded or failed
    log_path: Path | None = None
    preset_args: list[str] = field(default_factory=list)  # its --models-preset flags (the command line's win)
    stop_timeout: float = STOP_TIMEOUT

    def listing(self) -> dict[str, object]:
        status: dict[str, object] = {"value": self.status}
        if self.args:
            status["args"] = self.args
        if self.failed:
            status.update(failed=True, exit_code=self.exit_code)
        return {"id": self.id, "object": "model", "owned_by": "specserve", "created": int(self.path.stat().st_mtime),
                "path": str(self.path), "status": status}


def find_models(models_dir: Path | None, with_catalog: bool = True) -> dict[str, ModelEntry]:
    """The GGUF files of a folder (a file: its name without .gguf; a subfolder of one GGUF file: the folder's name)
    and the installed catalog models (their catalog names)."""
    found: dict[str, ModelEntry] = {}
    if models_dir is not None:
        if not models_dir.is_dir():
            raise SpecserveError(f"--models-dir {models_dir}: not a folder")
        for item in sorted(models_dir.iterdir()):
            files = [item] if item.suffix == ".gguf" and item.is_file() else \
                sorted(item.glob("*.gguf")) if item.is_dir() else []
            if len(files) == 1:
                name = item.stem if item.is_file() else item.name
                found[name] = ModelEntry(name, files[0].resolve())
    if with_catalog:
        for row in catalog.listing():
            name = str(row["name"])
            if row["installed"] and name not in found:
                found[name] = ModelEntry(name, Path(str(row["path"])))
    return found


def end_with_parent() -> None:
    """(In a model's server, at start.) Where the router set PARENT_ENV: on Linux, SIGTERM when the router dies,
    even by SIGKILL, so no model's server outlives it holding its memory; a router already gone ends it now."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None:
        return
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):
        raise SystemExit(0)


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("%s", task.exception())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ModelInstances:
    """The router's models and their processes (one event loop drives it: loads and stops are awaited)."""

    def __init__(self, models: dict[str, ModelEntry], child_args: list[str], models_max: int, autoload: bool,
                 child_env: dict[str, str] | None = None, load_timeout: float = 600.0):
        self.models = models
        self.child_args = child_args  # flags every model's server gets
        self.child_env = child_env
        self.models_max = models_max  # 0: no limit
        self.autoload = autoload
        self.load_timeout = load_timeout
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))
        self.load_at_start: list[str] = []  # (--models-preset's load-on-startup)
        self._starting: list[asyncio.Task] = []

    def entry(self, name: str) -> ModelEntry:
        if name not in self.models:
            raise KeyError(name)
        return self.models[name]

    async def ready(self, name: str, autoload: bool | None = None) -> ModelEntry:
        """The model loaded (loading it, or waiting for its load, where autoload allows); raises KeyError for an
        unknown name, LookupError for an unloaded one without autoload, RuntimeError when its load fails."""
        self.check_crashed()
        entry = self.entry(name)
        if entry.status == "unloaded":
            if not (self.autoload if autoload is None else autoload):
                raise LookupError(f"model '{name}' is not loaded (POST /models/load, or autoload)")
            await self.load(name)
        elif entry.status == "loading":
            assert entry.ready is not None
            await entry.ready.wait()
            if entry.status != "loaded":
                raise RuntimeError(f"model '{name}' failed to load (exit code {entry.exit_code})")
        entry.last_used = time.monotonic()
        return entry

    async def load(self, name: str) -> ModelEntry:
        """Start the model's server and wait until it answers /health (already loaded: nothing to do)."""
        entry = self.entry(name)
        if entry.status == "loaded":
            return entry
        if entry.status == "loading":
            return await self.ready(name)
        entry.status, entry.failed, entry.exit_code = "loading", False, None  # (before any await: one load a model)
        entry.ready = asyncio.Event()
        try:
            # a file that is no model fails here, before --models-max unloads another for it
            await asyncio.to_thread(GGUFFile, entry.path)
            await self._make_room(entry)
        except BaseException as exc:
            entry.status, entry.failed = "unloaded", isinstance(exc, SpecserveError)
            entry.ready.set()
            if isinstance(exc, SpecserveError):
                raise RuntimeError(f"model '{name}' cannot load: {exc}") from None
            raise
        port, entry.key = _free_port(), secrets.token_hex(16)
        entry.args = ["specserve", "serve", "-m", str(entry.path), "-a", name, *entry.preset_args, *self.child_args]
        entry.url = f"http://127.0.0.1:{port}"
        entry.log_path = Path(tempfile.gettempdir()) / f"specserve-router-{port}.log"
        cmd = [sys.executable, "-m", "specserve.cli", *entry.args[1:], "--host", "127.0.0.1", "--port", str(port),
               "--api-key", entry.key]
        log.info("loading %s: %s", name, " ".join(entry.args))
        with open(entry.log_path, "w") as out:  # the child keeps its own copy of the descriptor
            env = {**(self.child_env if self.child_env is not None else os.environ), PARENT_ENV: str(os.getpid())}
            entry.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            await self._wait_healthy(entry)
            entry.status = "loaded"
            entry.last_used = time.monotonic()
            log.info("%s loaded (%s)", name, entry.url)
        except RuntimeError:
            await self._stop(entry)
            entry.failed = True
            raise
        finally:
            entry.ready.set()
        return entry

    async def _wait_healthy(self, entry: ModelEntry) -> None:
        deadline = time.monotonic() + self.load_timeout
        assert entry.proc is not None
        while time.monotonic() < deadline:
            code = entry.proc.poll()
            if code is not None:
                entry.exit_code = code
                tail = entry.log_path.read_text(errors="replace").strip().splitlines()[-1:] if entry.log_path else []
                raise RuntimeError(f"model '{entry.id}' failed to load (exit code {code}): {' '.join(tail)}")
            with contextlib.suppress(httpx.TransportError):
                r = await self.client.get(entry.url + "/health", timeout=5)
                if r.status_code == 200:
                    return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"model '{entry.id}' did not load within {self.load_timeout:.0f} s")

    async def _make_room(self, loading: ModelEntry) -> None:
        """Stop the least recently used loaded models until `loading` fits under --models-max."""
        while self.models_max > 0:
            busy = [e for e in self.models.values() if e.status in ("loaded", "loading") and e is not loading]
            idle = sorted((e for e in busy if e.status == "loaded"), key=lambda e: e.last_used)
            if len(busy) < self.models_max or not idle:
                return
            log.info("unloading %s (least recently used; --models-max %d)", idle[0].id, self.models_max)
            await self.unload(idle[0].id)

    async def unload(self, name: str) -> None:
        entry = self.entry(name)
        if entry.status == "unloaded":
            raise LookupError(f"model '{name}' is not loaded")
        if entry.status == "loading" and entry.ready is not None:
            await entry.ready.wait()
        await self._stop(entry)

    async def _stop(self, entry: ModelEntry) -> None:
        """SIGTERM (its server drains its requests), then SIGKILL after STOP_TIMEOUT."""
        proc, entry.proc = entry.proc, None
        entry.status = "unloaded"
        if proc is None or proc.poll() is not None:
            entry.exit_code = proc.returncode if proc is not None else None
            return
        proc.terminate()
        deadline = time.monotonic() + entry.stop_timeout
        while proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
            await asyncio.to_thread(proc.wait)
        entry.exit_code = proc.returncode

    def check_crashed(self) -> None:
        """A loaded model whose process ended on its own is unloaded (and marked failed)."""
        for entry in self.models.values():
            if entry.status == "loaded" and entry.proc is not None and entry.proc.poll() is not None:
                entry.status, entry.failed, entry.exit_code, entry.proc = "unloaded", True, entry.proc.returncode, None

    async def start(self) -> None:
        """Begin the loads asked for at start (their failures are logged and listed, not raised)."""
        for name in self.load_at_start:
            task = asyncio.create_task(self.load(name))
            task.add_done_callback(_log_failure)
            self._starting.append(task)

    async def close(self) -> None:
        for entry in self.models.values():
            if entry.proc is not None:
                await self._stop(entry)
        await self.client.aclose()
