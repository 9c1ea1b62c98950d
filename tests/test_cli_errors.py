"""Bad input on the command line: a clear message, a non-zero exit, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from specserve.errors import SpecserveError
from specserve.gguf.reader import GGUFFile


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "specserve.cli", *args], capture_output=True, text=True,
                          timeout=300)


def assert_clean_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("error: ") or "usage:" in result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


def test_non_gguf_file(tmp_path: Path) -> None:
    bogus = tmp_path / "notes.gguf"
    bogus.write_text("this is not a model\n")
    assert_clean_error(run_cli("generate", "-m", str(bogus), "-p", "hi", "-n", "1"), "not a GGUF file")


@pytest.mark.parametrize("keep_bytes", [2_000, 3_000_000, 50_000_000])
def test_truncated_gguf(smollm_path: Path, tmp_path: Path, keep_bytes: int) -> None:
    cut = tmp_path / "cut.gguf"
    with open(smollm_path, "rb") as src:
        cut.write_bytes(src.read(keep_bytes))
    with pytest.raises(SpecserveError, match="truncated|damaged"):
        GGUFFile(cut)
    assert_clean_error(run_cli("generate", "-m", str(cut), "-p", "hi", "-n", "1"), str(cut))


def test_unknown_model_name() -> None:
    assert_clean_error(run_cli("generate", "-m", "llama-9000", "-p", "hi"), "unknown model 'llama-9000'")
    assert_clean_error(run_cli("models", "pull", "llama-9000"), "unknown model")


def test_bad_flags(smollm_path: Path) -> None:
    assert_clean_error(run_cli("generate", "-p", "hi", "--spec-type", "magic"), "unknown speculative type")
    assert_clean_error(run_cli("generate", "-p", "hi", "--spec-ngram-size-n", "0"), "ngram_size_n")
    assert_clean_error(run_cli("generate", "-p", "hi", "--top-p", "7"), "top_p")
    assert_clean_error(run_cli("generate", "-p", "hi", "--weight-format", "fp4"), "invalid choice")


def test_models_list_and_path(smollm_path: Path) -> None:
    listed = run_cli("models", "list")
    assert listed.returncode == 0
    assert "smollm2-135m" in listed.stdout and "qwen2.5-coder-1.5b" in listed.stdout
    path = run_cli("models", "path", "smollm2-135m")
    assert path.returncode == 0 and path.stdout.strip() == str(smollm_path)


def test_devices_this_machine_cannot_run_are_clear_errors(smollm_path: Path) -> None:
    import torch

    from specserve.engine.local_runner import checked_device

    assert checked_device("cpu") == torch.device("cpu")
    for bad, needle in (("bogus", "unknown device"), ("cuda:99", "--device cuda:99")):
        with pytest.raises(SpecserveError, match=needle):
            checked_device(bad)
    if not torch.cuda.is_available():
        with pytest.raises(SpecserveError, match="use --device cpu"):
            checked_device("cuda")
        # the server refuses before it listens, in one line
        assert_clean_error(run_cli("serve", "-m", str(smollm_path), "--device", "cuda", "--port", "0"),
                           "--device cuda")


def test_foreign_processes_get_the_environment_without_specserves_thread_defaults(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """specserve sets OMP_WAIT_POLICY=PASSIVE for itself; a reference engine started by a benchmark
    (llama.cpp decodes ~4x slower under it) gets the variable only where the user had set it."""
    import specserve

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setattr(specserve, "OMP_WAIT_POLICY_SET", True)
    assert "OMP_WAIT_POLICY" not in specserve.foreign_env()
    monkeypatch.setattr(specserve, "OMP_WAIT_POLICY_SET", False)  # the user's own setting stays
    assert specserve.foreign_env()["OMP_WAIT_POLICY"] == "PASSIVE"
