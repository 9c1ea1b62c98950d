"""The package type-checks: mypy, as pyproject.toml's [tool.mypy] sets it up, reports no error.

mypy takes about a minute on the CI box, mostly reading torch's types; conftest.py starts it in a process of its own
as soon as this test is collected (`start_mypy`), so it runs beside the other tests and this one waits for it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_RUN: subprocess.Popen[str] | None = None


def start_mypy() -> None:
    global _RUN
    if _RUN is None:
        _RUN = subprocess.Popen([sys.executable, "-m", "mypy"], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)


def test_mypy_is_clean() -> None:
    start_mypy()
    assert _RUN is not None
    out, _ = _RUN.communicate(timeout=600)
    assert _RUN.returncode == 0, out
