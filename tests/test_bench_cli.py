"""`specserve bench` end to end on the CPU: the table, the JSON, and clean errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specserve.cli import main


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "specserve.cli", "bench", *args], capture_output=True, text=True,
                          timeout=600)


def test_bench_in_process_writes_table_and_json(smollm_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The cheap equivalent of the end-to-end run below: one speculative type, one pass. Its own code-edit prompt,
    so the test does not depend on where the checkout sits beside ../shared."""
    workloads = tmp_path / "prompts.json"
    edit = "Rename x to count in:\ndef f(x):\n    return x + x\n"
    workloads.write_text(json.dumps({"code_edit": [{"messages": [{"role": "user", "content": edit}]}]}))
    monkeypatch.setenv("SPECSERVE_WORKLOADS", str(workloads))
    out = tmp_path / "bench.json"
    assert main(["bench", "-m", str(smollm_path), "--device", "cpu", "-p", "16", "-n", "4", "--no-hf",
                 "--spec-types", "ngram-suffix", "--repeat", "1", "--draft-tree", "8", "-o", str(out)]) == 0
    captured = capsys.readouterr()
    assert "tg4 code-edit ngram-suffix" in captured.out
    progress = [line for line in captured.err.splitlines() if line.startswith("bench: ")]
    names = [line.split(":")[1].strip() for line in progress if "t/s" in line]  # as each figure is measured
    assert names[:3] == ["pp16", "tg4", "tg4 code-edit none"]
    data = json.loads(out.read_text())
    assert data["pp16"] > 0 and data["tg4"] > 0 and data["code_edit_none"] > 0
    spec = data["code_edit_spec"]["ngram-suffix"]
    assert spec["identical"] is True and spec["tokens_per_s"] > 0
    assert data["code_edit_spec"]["ngram-suffix (no overlap)"]["identical"] is True
    assert data["code_edit_spec"]["ngram-suffix tree 8"]["identical"] is True


@pytest.mark.slow
def test_bench_writes_table_and_json(smollm_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = run_bench("-m", str(smollm_path), "--device", "cpu", "-p", "16", "-n", "4", "--no-hf",
                       "--spec-types", "ngram-simple", "--ngram-sizes", "12,3", "--repeat", "2", "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert "pp16" in result.stdout and "tg4 code-edit ngram-simple n=3" in result.stdout
    data = json.loads(out.read_text())
    assert data["pp16"] > 0 and data["tg4"] > 0 and data["code_edit_none"] > 0
    assert data["decode_step_ms"] > 0 and data["verify8_step_ms"] > 0
    assert set(data["step_ms_by_rows"]) == {"1", "2", "4", "8", "9", "16", "17"}
    for label in ("ngram-simple n=12", "ngram-simple n=3", "ngram-simple n=12 (no overlap)"):  # one row per key
        # length, and the first type again with one step at a time
        spec = data["code_edit_spec"][label]
        assert spec["identical"] is True and spec["tokens_per_s"] > 0


def test_bench_refuses_unknown_type(smollm_path: Path) -> None:
    result = run_bench("-m", str(smollm_path), "--device", "cpu", "--spec-types", "magic", "--no-hf")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "unknown speculative type(s): magic" in result.stderr


def test_bench_refuses_bad_ngram_sizes(smollm_path: Path) -> None:
    for sizes, message in (("x", "--ngram-sizes takes integers"), ("0", "ngram_size_n = 0 is out of range")):
        result = run_bench("-m", str(smollm_path), "--device", "cpu", "--ngram-sizes", sizes, "--no-hf")
        assert result.returncode == 1 and "Traceback" not in result.stderr
        assert message in result.stderr


def test_bench_refuses_a_tree_too_big(smollm_path: Path) -> None:
    result = run_bench("-m", str(smollm_path), "--device", "cpu", "--draft-tree", "65", "--no-hf")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "tree_nodes = 65 is out of range" in result.stderr


def test_bench_refuses_zero_repeats(smollm_path: Path) -> None:
    result = run_bench("-m", str(smollm_path), "--device", "cpu", "--repeat", "0", "--no-hf")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "--repeat must be at least 1" in result.stderr
