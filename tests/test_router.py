"""Router mode through a real `specserve serve --models-dir DIR`: two models found in a folder, loaded on first use
and on POST /models/load, one loading while the other serves, --models-max unloading the least recently used,
/models/unload, streams passed through, and errors as error bodies."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from specserve.cli import build_parser
from specserve.cli.model_presets import read_presets
from specserve.cli.serve_router import apply_presets, child_args, serve_flags
from specserve.errors import SpecserveError
from specserve.server.model_router import find_models
from tests.server_utils import ServerProcess, served
from tests.test_webui import chromium

PROMPT = "def fibonacci(n):"
SERVE_FLAGS = serve_flags(build_parser().parse_args(["serve"]).serve_parser)


@pytest.fixture(scope="module")
def models_dir(smollm_path: Path, tmp_path_factory) -> Path:
    """Two models, alpha and beta (the same file under two names: the routing, not the weights, is under test)."""
    d = tmp_path_factory.mktemp("router_models")
    (d / "alpha.gguf").symlink_to(smollm_path)
    (d / "beta").mkdir()
    (d / "beta" / "beta-q4_1.gguf").symlink_to(smollm_path)
    (d / "notes.txt").write_text("not a model")
    (d / "broken.gguf").write_text("this is not a GGUF file")  # listed; its load fails
    return d


@pytest.fixture(scope="module")
def router(models_dir: Path) -> Iterator[ServerProcess]:
    yield from served("--models-dir", str(models_dir), "--models-max", "1", "--device", "cpu", "-np", "2",
                      "-c", "1024", "--api-key", "secret", api_key="secret")


def statuses(srv: ServerProcess) -> dict[str, str]:
    return {m["id"]: m["status"]["value"] for m in srv.get("/v1/models").json()["data"]}


def completion(srv: ServerProcess, model: str, **fields) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "n_predict": 8, "temperature": 0, **fields}
    return srv.post("/v1/completions", body, timeout=300)


def test_child_args_leave_the_routers_own_flags() -> None:
    argv = ["serve", "--models-dir", "/m", "--models-max=2", "--no-models-autoload", "--port", "9", "-np", "4",
            "--host", "0.0.0.0", "--api-key", "k", "-c", "8192", "--metrics"]
    assert child_args(argv) == ["-np", "4", "-c", "8192", "--metrics"]


def test_routes_by_model_and_keeps_one_loaded(router: ServerProcess) -> None:
    listed = statuses(router)
    assert listed["alpha"] == listed["beta"] == "unloaded" and "notes" not in listed
    a = completion(router, "alpha")
    assert a.status_code == 200, a.text
    assert a.json()["model"] == "alpha"
    assert statuses(router)["alpha"] == "loaded"
    b = completion(router, "beta")
    assert b.status_code == 200, b.text
    # the same file under two names: the same greedy text; --models-max 1 unloaded alpha for beta
    assert b.json()["choices"][0]["text"] == a.json()["choices"][0]["text"]
    now = statuses(router)
    assert now["beta"] == "loaded" and now["alpha"] == "unloaded"


def test_streams_pass_through(router: ServerProcess) -> None:
    events = list(router.stream("/v1/chat/completions", {"model": "beta", "stream": True, "max_tokens": 6,
                                                          "messages": [{"role": "user", "content": "Hi"}]}))
    assert events[-1] == "[DONE]"
    assert any(e["choices"] and e["choices"][0]["delta"].get("content") for e in events[:-1])


def test_cors_from_the_router(router: ServerProcess) -> None:
    """The router answers preflights (no model, no key in them) and gives forwarded answers one CORS header."""
    origin = {"Origin": "http://example.test"}
    pre = httpx.options(router.url + "/v1/completions", headers={**origin, "Access-Control-Request-Method": "POST",
                                                                  "Access-Control-Request-Headers": "authorization"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] in ("*", origin["Origin"])
    r = router.post("/v1/completions", {"model": "beta", "prompt": PROMPT, "n_predict": 2}, headers=origin,
                    timeout=300)
    assert r.status_code == 200
    assert len(r.headers.get_list("access-control-allow-origin")) == 1


def test_errors_are_error_bodies(router: ServerProcess) -> None:
    r = completion(router, "gamma")
    assert r.status_code == 404 and "gamma" in r.json()["error"]["message"]
    r = router.post("/models/load", {"name": "alpha"})
    assert r.status_code == 400
    r = httpx.get(router.url + "/v1/models")  # no key
    assert r.status_code == 401
    r = router.post("/models/unload", {"model": "gamma"})
    assert r.status_code == 404


def test_page_picks_a_model(router: ServerProcess) -> None:
    """The chat page on a router: after the key, a picker of the folder's models; the picked one loads and
    answers a message (its name shown as the page's model)."""
    with chromium() as browser:
        _pick_and_chat(router, browser)


def _pick_and_chat(router: ServerProcess, browser: Any) -> None:
    page = browser.new_page(viewport={"width": 1200, "height": 800})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(router.url + "/")
    page.wait_for_selector('#server-status[data-state="needs-key"]', timeout=15_000)
    page.fill("#api-key", "secret")
    page.click("#save-key")
    page.wait_for_selector("#model-pick:not([hidden])", timeout=15_000)
    options = page.eval_on_selector_all("#model-pick option", "os => os.map(o => o.value)")
    assert {"alpha", "beta"} <= set(options)
    page.select_option("#model-pick", "alpha")
    page.wait_for_selector('#server-status[data-state="ready"]', timeout=120_000)
    assert page.text_content("#model-name") == "alpha"
    page.fill("#s-temperature", "0")
    page.fill("#s-max_tokens", "8")
    page.fill("#prompt", "Say hello.")
    page.keyboard.press("Enter")
    page.wait_for_selector('#messages .msg.assistant[data-state="done"]', timeout=60_000)
    assert (page.text_content("#messages .msg.assistant .text") or "").strip()
    assert statuses(router)["alpha"] == "loaded" and not errors


PRESET = """version = 1
[*]
LLAMA_ARG_N_PREDICT = 3
metrics = true
[gamma]
model = {path}
c = 256
stop-timeout = 2
"""


def test_presets_become_flags(models_dir: Path, smollm_path: Path, tmp_path: Path) -> None:
    ini = tmp_path / "models.ini"
    ini.write_text(PRESET.format(path=smollm_path) + "[alpha]\nwebui = false\nload-on-startup = true\n")
    models = find_models(models_dir, with_catalog=False)
    startup = apply_presets(models, read_presets(ini, *SERVE_FLAGS))
    assert startup == ["alpha"]
    assert models["gamma"].path == smollm_path.resolve() and models["gamma"].stop_timeout == 2
    assert models["gamma"].preset_args == ["--n-predict", "3", "--metrics", "--ctx-size", "256"]
    assert models["alpha"].preset_args == ["--n-predict", "3", "--metrics", "--no-webui"]
    for bad, why in (("[*]\nport = 9\n", "router's own"), ("[*]\nfrobnicate = 1\n", "not a serve flag"),
                     ("[*]\nmetrics = maybe\n", "not a boolean"), ("[zeta]\nc = 9\n", "model = PATH")):
        ini.write_text(bad)
        with pytest.raises(SpecserveError, match=why):
            apply_presets(find_models(models_dir, with_catalog=False), read_presets(ini, *SERVE_FLAGS))


@pytest.fixture(scope="module")
def manual(models_dir: Path, smollm_path: Path, tmp_path_factory) -> Iterator[ServerProcess]:
    ini = tmp_path_factory.mktemp("presets") / "models.ini"
    ini.write_text(PRESET.format(path=smollm_path))
    yield from served("--models-dir", str(models_dir), "--models-preset", str(ini), "--models-max", "2",
                      "--no-models-autoload", "--device", "cpu", "-np", "1", "-c", "512")


def test_loads_on_request_and_serves_while_another_loads(manual: ServerProcess) -> None:
    """--no-models-autoload: a request for an unloaded model is a 400 (?autoload=true loads it); POST /models/load
    loads, and alpha answers while beta's process starts (which takes seconds)."""
    r = completion(manual, "alpha")
    assert r.status_code == 400 and "not loaded" in r.json()["error"]["message"]
    assert manual.post("/models/load", {"model": "alpha"}).json() == {"success": True}
    loaded_at: list[float] = []

    def load_beta() -> None:
        assert manual.post("/models/load", {"model": "beta"}, timeout=300).json() == {"success": True}
        loaded_at.append(time.monotonic())

    loader = threading.Thread(target=load_beta)
    loader.start()
    deadline = time.monotonic() + 60
    while statuses(manual)["beta"] != "loading" and time.monotonic() < deadline:
        time.sleep(0.02)
    r = completion(manual, "alpha")
    answered_at = time.monotonic()
    loader.join(300)
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
    assert loaded_at and answered_at < loaded_at[0]
    now = statuses(manual)
    assert now["alpha"] == now["beta"] == "loaded"
    r = manual.post("/v1/completions?autoload=true", {"model": "beta", "prompt": PROMPT, "n_predict": 4})
    assert r.status_code == 200
    r = manual.post("/completion", {"model": "beta", "prompt": PROMPT, "temperature": 0, "ignore_eos": True})
    assert r.json()["tokens_predicted"] == 3  # the preset's [*] n-predict
    assert "gamma" in statuses(manual)
    assert manual.post("/models/unload", {"model": "alpha"}).json() == {"success": True}
    assert statuses(manual)["alpha"] == "unloaded"
    r = manual.post("/models/unload", {"model": "alpha"})
    assert r.status_code == 400 and "not loaded" in r.json()["error"]["message"]


def test_a_model_that_fails_to_load(manual: ServerProcess) -> None:
    """A file that is no model: its load is a 500 naming the failure, found before any loaded model is unloaded
    for it; it is listed unloaded and failed, and the other models go on answering."""
    before = statuses(manual)
    r = manual.post("/models/load", {"model": "broken"}, timeout=300)
    assert r.status_code == 500 and "not a GGUF file" in r.json()["error"]["message"]
    listed = {m["id"]: m["status"] for m in manual.get("/v1/models").json()["data"]}
    assert listed["broken"]["value"] == "unloaded" and listed["broken"]["failed"] is True
    assert {k: v["value"] for k, v in listed.items() if k != "broken"} == {k: v for k, v in before.items()
                                                                           if k != "broken"}
    r = manual.post("/v1/completions?autoload=true", {"model": "beta", "prompt": PROMPT, "n_predict": 2})
    assert r.status_code == 200


def test_models_end_with_a_killed_router(manual: ServerProcess) -> None:
    """A router killed outright (SIGKILL, no shutdown) leaves no model server behind. (Last: it ends `manual`.)"""
    import os
    import re
    import signal

    name = next(m for m, status in statuses(manual).items() if status == "loaded")
    port = re.findall(rf"{name} loaded \(http://127\.0\.0\.1:(\d+)\)", manual.log())[-1]
    children = [int(p) for p in os.listdir("/proc") if p.isdigit() and
                f"--port\0{port}\0".encode() in _cmdline(int(p))]
    assert len(children) == 1
    os.kill(manual.proc.pid, signal.SIGKILL)
    manual.proc.wait(10)
    # SIGTERM makes it drain (up to --shutdown-grace, 10 s) and stop its engine core: on a busy 2-core box that
    # once took over 20 s
    deadline = time.monotonic() + 60
    while _alive(children[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(children[0])


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    """Running, not a zombie (a reaped-later child of a dead parent is reparented and reaped by init)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False
