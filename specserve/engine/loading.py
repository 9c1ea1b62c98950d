"""Loading the served model: the target's runner and, with a draft model, the draft's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specserve.engine.local_runner import LocalRunner
from specserve.gguf.vocab_check import check_vocab_compatible


def load_with_draft(target: Path, draft: Path | None, **runner_args: Any) -> tuple[LocalRunner, LocalRunner | None]:
    """The target's runner and, if a draft model is given, the draft's: same settings and context
    size, vocabulary checked against the target's."""
    runner = LocalRunner(target, **runner_args)
    if draft is None:
        return runner, None
    draft_runner = LocalRunner(draft, **{**runner_args, "n_ctx": runner.n_ctx})
    check_vocab_compatible(runner.gguf.metadata, draft_runner.gguf.metadata)
    return runner, draft_runner
