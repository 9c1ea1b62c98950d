"""The chat page at GET /: served without a key, and used in a real browser (headless Debian chromium, Playwright).

The browser comes from Debian's `chromium` package: the session fixture installs it with apt-get when it is
missing and this process can (root, apt-get present); otherwise the browser test skips and says why. Playwright's
own browser download is never used (it needs the internet). Screenshots go to test-artifacts/webui/.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from specserve.server.app import create_app
from specserve.server.settings import ServerSettings
from specserve.server.webui import STATIC_DIR
from tests.server_utils import REPO, ServerProcess

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = REPO / "test-artifacts" / "webui"
API_KEY = "webui-key"
# smollm2's greedy answer to this goes on past 300 tokens: the stop button has something to stop.
LONG_PROMPT = "Write a very long story about a dragon."


def _apt(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.run(["apt-get", *args], env=env, capture_output=True, text=True, timeout=900,
                          stdin=subprocess.DEVNULL)


def _install_chromium() -> str | None:
    """None once /usr/bin/chromium exists, else why it cannot be had here."""
    if CHROMIUM.exists():
        return None
    if shutil.which("apt-get") is None:
        return "no apt-get on this machine to install Debian's chromium"
    if os.geteuid() != 0:
        return "not root, so Debian's chromium cannot be installed (apt-get install chromium)"
    done = _apt("install", "-y", "-q", "chromium")
    if done.returncode != 0:  # a fresh machine may have no package lists yet
        _apt("update", "-q")
        done = _apt("install", "-y", "-q", "chromium")
    if done.returncode != 0 or not CHROMIUM.exists():
        return f"apt-get install chromium failed: {(done.stderr or done.stdout).strip()[-300:]}"
    return None


@contextmanager
def chromium() -> Iterator[Any]:
    """Debian's chromium under Playwright (skips the test, saying why, where it cannot be had). Playwright's sync
    API runs an event loop while open: close it before tests that start their own (asyncio.run)."""
    why = _install_chromium()
    if why is not None:
        pytest.skip(f"no browser for the chat page test: {why}")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        # --no-sandbox: tests run as root, where chromium's sandbox refuses to start
        b = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                               args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as b:
        yield b


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    # One slot with room for a long answer; an API key, so the page has to ask for it.
    srv = ServerProcess("-m", "smollm2-135m", "--device", "cpu", "-np", "1", "-c", "4096", "--api-key", API_KEY,
                        api_key=API_KEY)
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


# ---- without a browser -------------------------------------------------------------------------------


def test_page_and_files_need_no_key(server: ServerProcess) -> None:
    page = httpx.get(server.url + "/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '/static/app.js' in page.text and '/static/app.css' in page.text
    for name, kind in (("app.js", "javascript"), ("app.css", "text/css")):
        r = httpx.get(f"{server.url}/static/{name}", timeout=10)
        assert r.status_code == 200 and kind in r.headers["content-type"], name
    assert httpx.get(server.url + "/props", timeout=10).status_code == 401  # the API still needs the key
    assert httpx.get(server.url + "/static/nothing.js", timeout=10).status_code == 404
    assert httpx.get(server.url + "/static/%2e%2e/app.py", timeout=10).status_code == 404


def test_page_is_served_while_the_model_loads() -> None:
    client = TestClient(create_app(ServerSettings()))  # no lifespan: the model never loads
    assert client.get("/").status_code == 200
    assert client.get("/static/app.js").status_code == 200
    assert client.get("/props").status_code == 503


def test_no_webui_serves_the_api_alone() -> None:
    """--no-webui: no page and no static files, nor their pass past the API key and the loading gate."""
    app = create_app(ServerSettings(webui=False))
    assert not {"/", "/static"} & {getattr(route, "path", None) for route in app.routes}
    client = TestClient(app)  # no lifespan: the model never loads
    assert client.get("/").status_code == 503 and client.get("/static/app.js").status_code == 503
    keyed = TestClient(create_app(ServerSettings(webui=False), api_key="k"))
    assert keyed.get("/").status_code == 401


def test_page_is_self_contained_and_escapes_output() -> None:
    files = {p.name: p.read_text() for p in STATIC_DIR.iterdir()}
    assert set(files) == {"index.html", "app.js", "app.css"}
    for name, text in files.items():  # the server may be offline: nothing from elsewhere
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//|url\(\s*["']?(https?:)?//|@import""", text), name
    # model output only ever reaches the page as text
    assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write", files["app.js"])


def test_browser_setup_says_why_it_cannot_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import tests.test_webui as me

    monkeypatch.setattr(me, "CHROMIUM", tmp_path / "chromium")  # not there
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/apt-get")
    assert "not root" in (me._install_chromium() or "")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert "no apt-get" in (me._install_chromium() or "")


# ---- in the browser ----------------------------------------------------------------------------------


def _slots_busy(server: ServerProcess) -> bool:
    return any(s["is_processing"] for s in server.get("/slots").json())


# Every text length the last assistant message shows, as it changes: several distinct ones mean it streamed.
WATCH_LENGTHS = """() => {
  window.lengths = [];
  new MutationObserver(() => {
    const texts = document.querySelectorAll('.msg.assistant .text');
    if (texts.length) window.lengths.push(texts[texts.length - 1].textContent.length);
  }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
}"""
LAST = "document.querySelector('#messages .msg.assistant:last-child')"


def _wait(page: Any, condition: str, what: str, timeout_ms: int = 30_000) -> None:
    """page.wait_for_function, failing with the page's last message and a screenshot."""
    try:
        page.wait_for_function(condition, timeout=timeout_ms)
    except Exception:
        page.screenshot(path=str(ARTIFACTS / "failed.png"))
        last = page.evaluate(f"(() => {{ const m = {LAST}; return m && [m.dataset.state, m.textContent]; }})()")
        pytest.fail(f"timed out waiting for {what}; last message: {last}; screenshot {ARTIFACTS / 'failed.png'}")


def test_chat_streams_and_stops_in_a_browser(server: ServerProcess, browser: Any,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page = browser.new_page(viewport={"width": 1200, "height": 800})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(server.url + "/")

    # The server has a key: the page says so, and works once it is given.
    page.wait_for_selector('#server-status[data-state="needs-key"]', timeout=15_000)
    page.fill("#api-key", API_KEY)
    page.click("#save-key")
    page.wait_for_selector('#server-status[data-state="ready"]', timeout=15_000)
    assert page.text_content("#model-name") == "smollm2-135m"
    options = page.eval_on_selector_all("#s-spec_type option", "os => os.map(o => o.value)")
    assert {"ngram-simple", "ngram-suffix", "none"} <= set(options) and "draft" not in options  # no -md

    # A message streams an answer; the final chunk's timings give tokens/s and draft acceptance.
    page.fill("#s-temperature", "0")
    page.fill("#s-max_tokens", "48")
    page.select_option("#s-spec_type", "ngram-suffix")  # drafts from the prompt: the answer copies it
    page.fill("#s-spec_n_max", "8")
    page.evaluate(WATCH_LENGTHS)
    page.fill("#prompt", "Repeat exactly, three times: the quick brown fox jumps over the lazy dog.")
    page.keyboard.press("Enter")
    page.wait_for_selector('#messages .msg.assistant[data-state="done"]', timeout=30_000)
    answer = page.text_content("#messages .msg.assistant .text") or ""
    stats = page.text_content("#messages .msg.assistant .stats") or ""
    assert answer.strip(), stats
    assert re.search(r"\d+ tokens · [\d.]+ tok/s · draft [1-9]\d*/\d+ accepted \(\d+%\)", stats), stats
    lengths = page.evaluate("window.lengths")
    assert len(set(lengths)) >= 3, lengths  # it arrived in pieces, not at once
    page.screenshot(path=str(ARTIFACTS / "1-answered.png"))

    # In a second conversation (its own settings), a long answer stopped midway: the stream ends, the page is
    # idle and the server frees the slot.
    page.click("#new-chat")
    assert page.locator("#conversations li").count() == 2 and page.locator("#messages .msg").count() == 0
    assert page.input_value("#s-max_tokens") == "" and page.input_value("#s-spec_type") == ""
    page.fill("#s-temperature", "0")
    page.fill("#s-max_tokens", "2000")
    page.fill("#prompt", LONG_PROMPT)
    page.click("#send")
    _wait(page, f"{LAST}.dataset.state === 'streaming' && {LAST}.querySelector('.text').textContent.length > 20",
          "the long answer streaming")
    assert _slots_busy(server)
    assert page.is_enabled("#stop") and not page.is_enabled("#send")
    page.screenshot(path=str(ARTIFACTS / "2-streaming.png"))
    page.click("#stop")
    page.wait_for_selector('#messages .msg.assistant:last-child[data-state="stopped"]', timeout=5_000)
    page.wait_for_selector('body[data-busy="false"]', timeout=5_000)
    assert server.wait_slots_idle(timeout=5) < 5
    stopped_text = page.text_content("#messages .msg.assistant:last-child .text")
    time.sleep(0.5)
    assert page.text_content("#messages .msg.assistant:last-child .text") == stopped_text  # nothing more came
    assert page.text_content("#messages .msg.assistant:last-child .stats").startswith("stopped")
    assert page.is_enabled("#send") and not page.is_enabled("#stop")
    page.screenshot(path=str(ARTIFACTS / "3-stopped.png"))

    # Both conversations survive a reload (localStorage), the stopped answer included.
    page.reload()
    page.wait_for_selector('#server-status[data-state="ready"]', timeout=15_000)
    assert page.locator("#conversations li").count() == 2
    assert page.locator("#messages .msg").count() == 2
    assert page.text_content("#messages .msg.assistant .text") == stopped_text
    page.click("#conversations li:nth-child(2) .open")
    assert page.text_content("#messages .msg.assistant .text") == answer
    assert page.input_value("#s-spec_type") == "ngram-suffix"
    assert errors == []
    page.close()
    with capsys.disabled():
        print(f"\nchat page screenshots: {ARTIFACTS}")


def _sse(*chunks: dict[str, Any]) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def test_reasoning_and_tool_calls_show_in_a_browser(server: ServerProcess, browser: Any) -> None:
    """The page shows a streamed answer's reasoning (collapsed) and its tool calls, and sends the tools setting. The
    answer is a canned stream (the small model neither reasons nor calls tools on its own), in the chunks the server
    sends (tests/test_server_tools.py checks those)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page = browser.new_page(viewport={"width": 1200, "height": 800})
    sent: list[dict[str, Any]] = []

    def delta(d: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": d, "finish_reason": finish}]}

    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    body = _sse(delta({"role": "assistant", "content": None}), delta({"reasoning_content": "The user wants "}),
                delta({"reasoning_content": "the weather."}), delta({"content": "Let me look."}),
                delta({"tool_calls": [call]}),
                delta({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]}),
                {**delta({}, "tool_calls"), "timings": {"predicted_n": 9, "predicted_per_second": 50.0, "draft_n": 0,
                                                       "prompt_n": 20, "cache_n": 0, "prompt_per_second": 500.0}})

    def answer(route: Any) -> None:
        sent.append(json.loads(route.request.post_data))
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=body)

    page.route("**/v1/chat/completions", answer)
    page.goto(server.url + "/")
    page.fill("#api-key", API_KEY)
    page.click("#save-key")
    page.wait_for_selector('#server-status[data-state="ready"]', timeout=15_000)
    page.click("#new-chat")
    tools = [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    page.fill("#s-tools", json.dumps(tools))
    page.fill("#prompt", "Weather in Paris?")
    page.keyboard.press("Enter")
    page.wait_for_selector('#messages .msg.assistant[data-state="done"]', timeout=15_000)
    assert sent[0]["tools"] == [{"type": "function", "function": tools[0]}]
    last = "#messages .msg.assistant:last-child"
    assert page.text_content(f"{last} .text") == "Let me look."
    assert page.text_content(f"{last} .tool-call") == 'tool call: get_weather({"city": "Paris"})'
    assert page.text_content(f"{last} .reasoning-text") == "The user wants the weather."
    assert page.is_visible(f"{last} .reasoning summary") and not page.is_visible(f"{last} .reasoning-text")
    page.click(f"{last} .reasoning summary")  # opened on demand
    assert page.is_visible(f"{last} .reasoning-text")
    page.screenshot(path=str(ARTIFACTS / "4-tool-call.png"))
    # the next turn sends the call back as the assistant's tool_calls
    page.fill("#prompt", "Thanks")
    page.keyboard.press("Enter")
    page.wait_for_selector(f'{last}[data-state="done"]', timeout=15_000)
    previous = sent[1]["messages"][-2]
    assert previous["role"] == "assistant" and previous["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}
    page.close()
