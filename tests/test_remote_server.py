"""The server's HTTP tests with the server on a RemoteRunner: `specserve remote-host` and `specserve serve
--remote` as two processes, over a unix socket (logits through shared memory) and over TCP. Every test of
tests/test_server.py that runs against its shared `server` runs here again, unchanged."""

from __future__ import annotations

import inspect
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import test_server
from tests.remote_utils import free_port
from tests.server_utils import REPO, ServerProcess

for _name, _test in vars(test_server).items():
    if _name.startswith("test_") and "server" in inspect.signature(_test).parameters:
        globals()[_name] = _test
client = test_server.client  # the openai client fixture, on this module's server


@pytest.fixture(scope="module", params=["unix", "tcp"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    address = (f"unix:{tmp_path_factory.mktemp('remote') / 'host.sock'}" if request.param == "unix"
               else f"tcp:127.0.0.1:{free_port()}")
    host = subprocess.Popen([sys.executable, "-m", "specserve.cli", "remote-host", "--listen", address], cwd=REPO,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert host.stderr is not None and "listening" in host.stderr.readline()
        env = {"LLAMA_ARG_N_PARALLEL": str(test_server.N_SLOTS),
               "LLAMA_ARG_CTX_SIZE": str(test_server.CTX),
               "LLAMA_API_KEY": test_server.API_KEY, "LLAMA_ARG_DRAFT_P_MIN": "0.5"}
        srv = ServerProcess("-m", "smollm2-135m", "--device", "cpu", "--metrics", "--remote", address, env=env,
                            api_key=test_server.API_KEY)
        try:
            yield srv.wait_ready()
        finally:
            srv.stop()
    finally:
        host.kill()
        host.wait(10)


def test_props_name_the_remote_model(server: ServerProcess, smollm_path: Path) -> None:
    props = server.get("/props").json()
    assert Path(props["model_path"]).name == smollm_path.name
