"""Benchmark prompts by category (code_edit, chat, extract), from the shared workload file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from specserve.errors import SpecserveError

if TYPE_CHECKING:
    from specserve.gguf.tokenizer import Tokenizer

# The project's shared folder sits beside the checkout (../shared); CI lays it out the same way.
DEFAULT_PATH = Path(__file__).resolve().parents[3] / "shared" / "workloads" / "prompts.json"


def workload_path(path: str | Path | None = None) -> Path:
    return Path(path or os.environ.get("SPECSERVE_WORKLOADS") or DEFAULT_PATH)


def load_workloads(path: str | Path | None = None) -> dict[str, list[list[dict[str, str]]]]:
    """{category: [messages, ...]}, each messages list ready for a chat template."""
    file = workload_path(path)
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        return {cat: [item["messages"] for item in items] for cat, items in data.items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SpecserveError(f"cannot read workload prompts from {file}: {exc}") from None


def workload_prompts(tokenizer: Tokenizer, category: str, path: str | Path | None = None) -> list[list[int]]:
    """The token ids of a category's prompts, each rendered with the model's chat template."""
    from specserve.gguf.chat_template import apply_chat_template

    return [tokenizer.encode(apply_chat_template(tokenizer, m), add_special=False)
            for m in load_workloads(path)[category]]
