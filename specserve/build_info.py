"""What build this is, shaped as llama-server shows its own (`b<build number>-<commit>`): the commit count and
short hash of the git checkout the package runs from, else the package version (an installed copy)."""

from __future__ import annotations

import subprocess
from functools import cache
from pathlib import Path

from specserve import __version__


@cache
def build_info() -> str:
    """`system_fingerprint` of OpenAI answers and `/props`' build_info."""
    root = Path(__file__).resolve().parent.parent
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True,
                                  timeout=5).stdout.strip()

        return f"b{git('rev-list', '--count', 'HEAD')}-{git('rev-parse', '--short=7', 'HEAD')}"
    except (OSError, subprocess.SubprocessError):
        return f"b{__version__}-release"
