"""The optional step timeline (SPECSERVE_STEP_TRACE): every launched step of a generation is recorded with its
host phases in order, and the summary script reads the file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specserve.engine import step_trace
from specserve.engine.generate import generate
from specserve.speculative.base import SpecParams
from specserve.speculative.factory import build_chain

ROOT = Path(__file__).resolve().parents[1]


def test_a_generation_leaves_one_record_per_step(smollm_runner, smollm_tokenizer, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    trace = step_trace.StepTrace(str(tmp_path / "trace.json"))
    monkeypatch.setattr(step_trace, "TRACE", trace)
    prompt = smollm_tokenizer.encode("def add(a, b):\n    return a + b\n\ndef add(a, b):\n")
    gen = generate(smollm_runner, smollm_tokenizer, prompt, 12, spec=SpecParams(type="ngram-suffix"),
                   chain_factory=lambda spec, slot: build_chain(spec, None, seq=slot))
    trace.dump()
    steps = json.loads((tmp_path / "trace.json").read_text())["steps"]
    assert steps[0]["prompt"] and steps[0]["rows"] == len(prompt)
    decode = steps[1:]
    # the prompt's logits give the first token; each decode step gives one or more (accepted drafts)
    assert 1 <= len(decode) <= len(gen.tokens) - 1
    assert sum(s["rows"] for s in decode) >= len(gen.tokens) - 1
    for s in steps:
        assert s["plan"] <= s["launch"] <= s["launched"]
        if "ready" in s:  # settled (a step in flight when the task ended may not be)
            assert s["launched"] <= s["wait"] <= s["ready"]
    summary = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_trace.py"), str(tmp_path / "trace.json")],
                             capture_output=True, text=True, check=True).stdout
    assert "prompt" in summary and "plain" in summary


def test_a_process_that_ran_no_step_leaves_the_file_alone(tmp_path: Path) -> None:
    """`specserve serve`'s front has the variable too and exits after the engine core wrote its steps."""
    path = tmp_path / "trace.json"
    path.write_text('{"steps": [{"rows": 1}]}')
    step_trace.StepTrace(str(path)).dump()
    assert json.loads(path.read_text())["steps"] == [{"rows": 1}]
