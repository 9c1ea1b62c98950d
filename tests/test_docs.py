"""docs/architecture.md stays short and names only files that exist.

The rule for the paths it names (its opening paragraph says the same): an inline backticked name with a slash or a
file suffix is a repository path. When its first part is a top-level entry of the repository (`tests/...`,
`benchmarks/...`, `docs/...`, `pyproject.toml`) it is read from the root; any other name (`engine/scheduler.py`,
`kernels/cuda/gemv_mma.cu`) is read from `specserve/`. Fenced code blocks are not read.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
MAX_LINES = 250
PACKAGE = "specserve"

SUFFIXES = ("py", "md", "toml", "json", "sh", "cu", "cuh", "c", "h", "txt", "html", "js", "css")
_NAME = re.compile(r"[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*/?")
_SUFFIX = re.compile(r"\.(?:" + "|".join(SUFFIXES) + r")$")


def _prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.MULTILINE | re.DOTALL)


def named_paths(text: str) -> list[str]:
    """The repository paths a markdown text names in inline backticks, in order, each once."""
    names: list[str] = []
    for span in re.findall(r"`([^`\n]+)`", _prose(text)):
        if _NAME.fullmatch(span) and ("/" in span or _SUFFIX.search(span)) and span not in names:
            names.append(span)
    return names


def resolve(name: str, root: Path = ROOT) -> Path:
    """Where a named path lives: from the root when its first part is a top-level entry, else under specserve/."""
    first = name.split("/", 1)[0]
    return root / name if (root / first).exists() else root / PACKAGE / name


@pytest.mark.parametrize(("name", "expected"), [
    ("engine/scheduler.py", "specserve/engine/scheduler.py"),
    ("kernels/cuda/gemv_mma.cu", "specserve/kernels/cuda/gemv_mma.cu"),
    ("tests/test_layers.py", "tests/test_layers.py"),
    ("benchmarks/serve_bench.py", "benchmarks/serve_bench.py"),
    ("pyproject.toml", "pyproject.toml"),
    ("catalog.py", "specserve/catalog.py"),
])
def test_resolution_rule(name: str, expected: str) -> None:
    assert resolve(name) == ROOT / expected


def test_what_counts_as_a_path() -> None:
    text = ("`engine/slots.py`, `server/static/`, `pyproject.toml`, `/v1/chat/completions`, `POST /health`, "
            "`unix:PATH|tcp:HOST:PORT`, `Batch.runs()`, `general.architecture`, `h // group`\n"
            "```\nengine/not_read.py\n```\n`engine/slots.py`")
    assert named_paths(text) == ["engine/slots.py", "server/static/", "pyproject.toml"]


def test_architecture_names_existing_paths() -> None:
    names = named_paths(DOC.read_text())
    assert len(names) > 50  # the doc names its files; an empty list would mean the reader broke
    missing = [f"{name} ({resolve(name).relative_to(ROOT)})" for name in names if not resolve(name).exists()]
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_architecture_stays_short() -> None:
    n_lines = len(DOC.read_text().splitlines())
    assert n_lines <= MAX_LINES, f"docs/architecture.md has {n_lines} lines (at most {MAX_LINES})"


def test_architecture_stays_in_the_repository() -> None:
    text = DOC.read_text()
    assert "../" not in text, "docs/architecture.md names a path outside the repository"
