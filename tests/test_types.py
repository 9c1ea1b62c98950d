"""The package type-checks and lints: mypy and ruff, as pyproject.toml sets them up, report no error.

mypy takes about a minute on the CI box, mostly reading torch's types; conftest.py starts it in a process of its own
as soon as this test is collected (`start_mypy`), so it runs beside the other tests and this one waits for it. A
thread waits on the process, so it leaves no zombie child for other tests to trip over."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_result: dict[str, object] = {}
_done = threading.Event()
_started = threading.Lock()


def _run() -> None:
    proc = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    _result.update(code=proc.returncode, out=proc.stdout + proc.stderr)
    _done.set()


def start_mypy() -> None:
    if _started.acquire(blocking=False):  # (once)
        threading.Thread(target=_run, name="mypy", daemon=True).start()


def test_mypy_is_clean() -> None:
    start_mypy()
    assert _done.wait(600), "mypy did not finish in 10 minutes"
    assert _result["code"] == 0, _result["out"]


def test_ruff_is_clean() -> None:
    """The package, its tests and benchmarks lint clean under pyproject.toml's [tool.ruff] (a second or two)."""
    ruff = Path(sys.executable).parent / "ruff"
    proc = subprocess.run([str(ruff), "check", "specserve", "tests", "benchmarks"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
